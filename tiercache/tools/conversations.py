"""Workloads made of real conversations (ShareGPT) as token ids through a model's chat template, all deterministic.

``ChatSegments`` turns each message into the token ids of its part of the chat
template (a system prompt, a user message with the assistant's generation
prompt, an answer with its end-of-turn), so that a chat's next prompt extends the
previous one token for token, as an engine's prefix cache needs. The workloads:

- ``ReplayChats`` (``replay_chats``): each user replays one conversation; round
  ``r``'s prompt is a shared system prompt, the conversation's first ``r``
  exchanges with their recorded answers, and its question ``r``. Every
  configuration sees the same prompts, whatever the engine answers.
- ``QuestionChats`` (``question_chats``): LMCache's multi-round QA shape. Users
  share the system prompt and each asks a new ShareGPT question per round; the
  chat so far holds the engine's own answers, so later prompts depend on them.
  ``followup_chats`` gives the same shape with each user's questions taken in
  order from one conversation (a live chat: the demo's).

``sharegpt_turn_tokens`` gives the (question, answer) token counts of
conversations, for workloads that only need lengths (the simulator's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tiercache.tools.sharegpt import Conversation

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the user's questions accurately and clearly, "
    "and keep the whole conversation in mind."
)
"""The system prompt every user of a workload shares."""
ASCII_SHARE = 0.98
"""A conversation is used only when at least this share of its characters is ASCII (the model is English-only)."""
SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
"""The chat template's role names."""

Answers = Sequence[Sequence[Sequence[int]]]
"""Per user, per round, the engine's answer (token ids)."""


class ChatTokenizer(Protocol):
    """What ``ChatSegments`` needs of a ``transformers`` tokenizer."""

    def apply_chat_template(self, conversation: list[dict[str, str]], **options: Any) -> Any: ...

    def __call__(self, text: str, **options: Any) -> Any: ...


class ChatSegments:
    """The token ids of each part of a chat through ``tokenizer``'s chat template, after a shared system prompt."""

    def __init__(self, tokenizer: ChatTokenizer, system_prompt: str = SYSTEM_PROMPT) -> None:
        self.tokenizer = tokenizer
        self.system_message = {"role": SYSTEM, "content": system_prompt}
        head = self._render([self.system_message])
        self.system = self.ids(head)
        probe = [self.system_message, {"role": USER, "content": "?"}]
        asked = self._render(probe)
        prompted = self._render(probe, generation=True)
        closed = self._render([*probe, {"role": ASSISTANT, "content": ""}])
        if not (asked.startswith(head) and prompted.startswith(asked) and closed.startswith(prompted)):
            raise ValueError("the chat template does not render a chat as a growing prefix; it cannot be segmented")
        self.generation = self.ids(prompted[len(asked):])
        """The assistant's generation prompt, after a user message."""
        self.answer_end = self.ids(closed[len(prompted):])
        """What closes an answer (its end-of-turn), after its content."""

    def _render(self, messages: list[dict[str, str]], generation: bool = False) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))

    def ids(self, text: str) -> list[int]:
        """``text``'s token ids, no special tokens added."""
        encoded = self.tokenizer(text, add_special_tokens=False)
        return list(encoded["input_ids"])

    def question(self, text: str) -> list[int]:
        """A user message's part, the generation prompt included (what a prompt ends with)."""
        head = self._render([self.system_message])
        asked = self._render([self.system_message, {"role": USER, "content": text}])
        return self.ids(asked[len(head):]) + self.generation

    def answer(self, text: str) -> list[int]:
        """A recorded answer's part: its content and its end-of-turn."""
        return self.ids(text) + self.answer_end


def mostly_ascii(conversation: Conversation) -> bool:
    """Whether at least ``ASCII_SHARE`` of the conversation's characters are ASCII."""
    text = "".join(exchange.question + exchange.answer for exchange in conversation.exchanges)
    return bool(text) and sum(character.isascii() for character in text) >= ASCII_SHARE * len(text)


@dataclass(frozen=True)
class ChatRounds:
    """Users chatting round by round after a shared system prompt: what both workloads share."""

    system: list[int]
    questions: list[list[list[int]]]
    """Per user, per round: the question's part, generation prompt included."""

    @property
    def users(self) -> int:
        return len(self.questions)

    @property
    def rounds(self) -> int:
        return len(self.questions[0]) if self.questions else 0

    def prompt(self, user: int, round_: int, answers: Answers | None = None) -> list[int]:
        """The prompt of ``user``'s round ``round_`` (``answers``: the engine's earlier ones, where they matter)."""
        raise NotImplementedError

    def order(self) -> list[tuple[int, int]]:
        """(user, round) in the order sent: round after round, every user in turn."""
        return [(user, round_) for round_ in range(self.rounds) for user in range(self.users)]

    def prompt_tokens(self, answers: Answers | None = None) -> list[list[int]]:
        """Per round, each user's prompt length."""
        return [[len(self.prompt(user, round_, answers)) for user in range(self.users)]
                for round_ in range(self.rounds)]


@dataclass(frozen=True)
class ReplayChats(ChatRounds):
    """Each user replays one conversation with its recorded answers (see the module docstring)."""

    answers: list[list[list[int]]]
    """Per user, per round: the recorded answer's part."""
    ids: list[str]
    """The conversations' ShareGPT ids, per user."""

    def prompt(self, user: int, round_: int, answers: Answers | None = None) -> list[int]:
        """The system prompt, the first ``round_`` exchanges as recorded, and question ``round_`` (``answers``, the
        engine's, are not used: every configuration sees the same prompts)."""
        tokens = list(self.system)
        for earlier in range(round_):
            tokens += self.questions[user][earlier] + self.answers[user][earlier]
        return tokens + self.questions[user][round_]


@dataclass(frozen=True)
class QuestionChats(ChatRounds):
    """Users share the system prompt and ask a new question each round; the chat holds the engine's answers."""

    answer_end: list[int]
    ids: list[list[str]]
    """Per user, per round: the ShareGPT id the question comes from."""

    def prompt(self, user: int, round_: int, answers: Answers | None = None) -> list[int]:
        """The system prompt, the user's earlier questions with ``answers`` (the engine's), and question ``round_``."""
        if round_ and answers is None:
            raise ValueError("a later round's prompt holds the engine's earlier answers: pass them")
        tokens = list(self.system)
        for earlier in range(round_):
            tokens += self.questions[user][earlier] + list(answers[user][earlier]) + self.answer_end  # type: ignore[index]
        return tokens + self.questions[user][round_]


def replay_chats(conversations: Iterable[Conversation], segments: ChatSegments, *, users: int, rounds: int,
                 max_prompt_tokens: int, skip: int = 0) -> ReplayChats:
    """The first ``users`` mostly-ASCII conversations (after ``skip``) with ``rounds`` exchanges whose last prompt has
    at most ``max_prompt_tokens`` tokens, in file order."""
    chosen: list[tuple[str, list[list[int]], list[list[int]]]] = []
    usable = (c for c in conversations if len(c.exchanges) >= rounds and mostly_ascii(c))
    for conversation in itertools.islice(usable, skip, None):
        exchanges = conversation.exchanges[:rounds]
        questions = [segments.question(exchange.question) for exchange in exchanges]
        answers = [segments.answer(exchange.answer) for exchange in exchanges[:-1]] + [[]]
        last = len(segments.system) + sum(map(len, questions)) + sum(map(len, answers))
        if last <= max_prompt_tokens:
            chosen.append((conversation.id, questions, answers))
        if len(chosen) == users:
            break
    if len(chosen) < users:
        raise ValueError(f"only {len(chosen)} conversations have {rounds} exchanges within {max_prompt_tokens} tokens")
    return ReplayChats(segments.system, [q for _, q, _ in chosen], [a for _, _, a in chosen], [i for i, _, _ in chosen])


def question_chats(conversations: Iterable[Conversation], segments: ChatSegments, *, users: int, rounds: int,
                   question_tokens: tuple[int, int], skip: int = 0) -> QuestionChats:
    """``users`` x ``rounds`` first questions of mostly-ASCII conversations (after ``skip``), each of
    ``question_tokens`` (inclusive range) tokens with its template, dealt round by round in file order."""
    found: list[tuple[str, list[int]]] = []
    usable = (c for c in conversations if mostly_ascii(c))
    for conversation in itertools.islice(usable, skip, None):
        question = segments.question(conversation.exchanges[0].question)
        if question_tokens[0] <= len(question) <= question_tokens[1]:
            found.append((conversation.id, question))
        if len(found) == users * rounds:
            break
    if len(found) < users * rounds:
        raise ValueError(f"only {len(found)} questions of {question_tokens} tokens, {users * rounds} wanted")
    dealt = [[found[round_ * users + user] for round_ in range(rounds)] for user in range(users)]
    return QuestionChats(segments.system, [[q for _, q in row] for row in dealt], segments.answer_end,
                         [[i for i, _ in row] for row in dealt])


def followup_chats(conversations: Iterable[Conversation], segments: ChatSegments, *, users: int, rounds: int,
                   question_tokens: tuple[int, int], skip: int = 0) -> QuestionChats:
    """A live chat's shape: each user asks the first ``rounds`` questions of one mostly-ASCII conversation (after
    ``skip``), each of ``question_tokens`` (inclusive range) tokens with its template, the chat holding the engine's
    own answers."""
    chosen: list[tuple[str, list[list[int]]]] = []
    usable = (c for c in conversations if len(c.exchanges) >= rounds and mostly_ascii(c))
    for conversation in itertools.islice(usable, skip, None):
        questions = [segments.question(exchange.question) for exchange in conversation.exchanges[:rounds]]
        if all(question_tokens[0] <= len(question) <= question_tokens[1] for question in questions):
            chosen.append((conversation.id, questions))
        if len(chosen) == users:
            break
    if len(chosen) < users:
        raise ValueError(f"only {len(chosen)} conversations have {rounds} questions of {question_tokens} tokens")
    return QuestionChats(segments.system, [q for _, q in chosen], segments.answer_end,
                         [[i] * rounds for i, _ in chosen])


def sharegpt_turn_tokens(conversations: Iterable[Conversation], count_tokens: Callable[[str], int], *, users: int,
                         rounds: int, max_message_tokens: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per user, per round, the (question, answer) token counts of the first ``users`` mostly-ASCII conversations with
    ``rounds`` exchanges, each count clipped to ``max_message_tokens`` (a few ShareGPT messages are whole files)."""
    found: list[tuple[tuple[int, int], ...]] = []
    for conversation in conversations:
        if len(conversation.exchanges) < rounds or not mostly_ascii(conversation):
            continue
        found.append(tuple((min(count_tokens(e.question), max_message_tokens),
                            min(count_tokens(e.answer), max_message_tokens)) for e in conversation.exchanges[:rounds]))
        if len(found) == users:
            return tuple(found)
    raise ValueError(f"only {len(found)} conversations have {rounds} exchanges, {users} wanted")

