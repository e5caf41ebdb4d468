"""Synthetic multi-turn chat workloads: users, shared system prompts, growing histories.

Token ids are drawn from a seeded generator, so a workload is reproducible and
prompts of one session share their history as a prefix, as real chats do. The
turns' lengths are fixed, or taken per user and round from real conversations
(``turn_tokens``, e.g. ``tiercache.tools.conversations.sharegpt_turn_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class ChatWorkload:
    """``users`` sessions of ``rounds`` turns, each prompt = system prompt + history + new turn."""

    users: int = 16
    rounds: int = 5
    system_prompts: int = 2
    system_tokens: int = 256
    user_tokens: int = 64
    reply_tokens: int = 96
    document_every: int = 0
    """Every N-th request is a one-off long document (a scan), when N > 0."""
    document_tokens: int = 2048
    seed: int = 0
    turn_tokens: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per user, per round, the (user message, reply) lengths; empty: ``user_tokens`` and ``reply_tokens`` always."""

    def __post_init__(self) -> None:
        if self.turn_tokens and (len(self.turn_tokens) != self.users
                                 or any(len(user) != self.rounds for user in self.turn_tokens)):
            raise ValueError(f"turn_tokens must give {self.rounds} rounds for each of {self.users} users")

    def turn(self, user: int, round_: int) -> tuple[int, int]:
        """The (user message, reply) lengths of ``user``'s round ``round_``."""
        return self.turn_tokens[user][round_] if self.turn_tokens else (self.user_tokens, self.reply_tokens)

    def requests(self) -> Iterator[tuple[int, np.ndarray]]:
        """(user, prompt tokens) in arrival order: round-robin over users, round by round."""
        rng = np.random.default_rng(self.seed)
        systems = [rng.integers(0, VOCAB_SIZE, self.system_tokens) for _ in range(self.system_prompts)]
        histories = [systems[user % self.system_prompts] for user in range(self.users)]
        count = 0
        for round_ in range(self.rounds):
            for user in range(self.users):
                count += 1
                if self.document_every and count % self.document_every == 0:
                    yield -1, rng.integers(0, VOCAB_SIZE, self.document_tokens)
                message, reply = self.turn(user, round_)
                prompt = np.concatenate([histories[user], rng.integers(0, VOCAB_SIZE, message)])
                yield user, prompt
                histories[user] = np.concatenate([prompt, rng.integers(0, VOCAB_SIZE, reply)])
