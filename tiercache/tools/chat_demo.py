"""The demo on a trained chat model: users ask ShareGPT questions turn by turn, their KV reused through tiers.

Each user asks one ShareGPT conversation's questions in order (``followup_chats``:
a shared system prompt, then the chat so far with the model's own answers, then
the next question); the model answers every question greedily through a
``ChatModel`` (what
``tiercache.integrations.transformers.CachedModel`` offers: lookup, load, the
uncached suffix's prefill, store). Per turn it reports the answer's first words,
the prompt tokens reused from each tier, the time to first token against a
recompute of the whole prompt with no cache, and whether both give the same first
token. The command line (``tiercache demo``) builds the model and the manager and
hands them here: this module needs neither ``transformers`` nor the integration.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tiercache.tools.conversations import ChatRounds

ANSWER_WORDS = 12
"""How much of each answer the demo prints."""
MS_PER_S = 1000.0
"""Milliseconds in a second (the demo prints milliseconds)."""


class ServedTurn(Protocol):
    """What a served request reports (``tiercache.integrations.transformers.Turn``)."""

    output: Any
    reused: dict[str, int]
    cached_tokens: int
    ttft_s: float | None

    @property
    def prompt_tokens(self) -> int: ...


class ChatModel(Protocol):
    """Serves one request through tiercache (``CachedModel.generate``)."""

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options: Any) -> ServedTurn: ...


Recompute = Callable[[torch.Tensor], tuple[float, int]]
"""A prompt ``[1, T]`` -> (seconds to its first token with no cache at all, that token)."""


@dataclass(frozen=True)
class DemoTurn:
    """One turn of the demo, as printed."""

    user: int
    round: int
    prompt_tokens: int
    reused: Mapping[str, int]
    ttft_s: float
    recompute_s: float
    same_first_token: bool
    answer: str

    @property
    def reused_tokens(self) -> int:
        return sum(self.reused.values())

    def line(self) -> str:
        """The turn's two lines: what was reused and saved, then the answer's first words."""
        tiers = ", ".join(f"{tier} {tokens}" for tier, tokens in self.reused.items() if tokens) or "nothing"
        saved = (self.recompute_s - self.ttft_s) * MS_PER_S
        words = self.answer.split()
        shown = " ".join(words[:ANSWER_WORDS]) + (" ..." if len(words) > ANSWER_WORDS else "")
        return (
            f"user {self.user + 1}, turn {self.round + 1}: {self.prompt_tokens} prompt tokens, reused "
            f"{self.reused_tokens} ({tiers}), computed {self.prompt_tokens - self.reused_tokens}; first token "
            f"{self.ttft_s * MS_PER_S:.0f} ms, recomputing {self.recompute_s * MS_PER_S:.0f} ms: saved {saved:.0f} ms; "
            f"same first token: {'yes' if self.same_first_token else 'NO'}\n    answer: {shown}"
        )


def run_chat_demo(chats: ChatRounds, model: ChatModel, recompute: Recompute, decode: Callable[[list[int]], str],
                  answer_tokens: int, stop_ids: Collection[int], show: Callable[[str], None] = print) -> list[DemoTurn]:
    """Serve every turn in order (round after round, users in turn), ``show`` each as it ends; the turns. Each answer
    joins its user's chat without a final stop token (``stop_ids``: the chat template closes the turn itself)."""
    turns = []
    answers: list[list[list[int]]] = [[[] for _ in range(chats.rounds)] for _ in range(chats.users)]
    for user, round_ in chats.order():
        prompt = torch.tensor([chats.prompt(user, round_, answers)])
        served = model.generate(prompt, max_new_tokens=answer_tokens, do_sample=False)
        recompute_s, first = recompute(prompt)
        answer = [int(token) for token in served.output[0, prompt.shape[1]:]]
        answers[user][round_] = answer[:-1] if answer and answer[-1] in stop_ids else answer
        turn = DemoTurn(user, round_, served.prompt_tokens, dict(served.reused), served.ttft_s or 0.0, recompute_s,
                        bool(answer) and answer[0] == first, decode(answer))
        show(turn.line())
        turns.append(turn)
    return turns


def summary(turns: list[DemoTurn]) -> str:
    """One line over every turn: tokens reused and prefill time saved."""
    prompt = sum(turn.prompt_tokens for turn in turns)
    reused = sum(turn.reused_tokens for turn in turns)
    ttft = sum(turn.ttft_s for turn in turns)
    recompute = sum(turn.recompute_s for turn in turns)
    same = sum(turn.same_first_token for turn in turns)
    return (
        f"reused {reused} of {prompt} prompt tokens ({reused / max(prompt, 1):.0%}); time to first token "
        f"{ttft:.1f} s against {recompute:.1f} s recomputing ({(recompute - ttft) / max(recompute, 1e-9):.0%} less); "
        f"same first token as a recompute in {same} of {len(turns)} turns"
    )
