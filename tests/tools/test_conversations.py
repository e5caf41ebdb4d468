"""Workloads of ShareGPT conversations through SmolLM2's chat template: prompts that grow as prefixes of each other,
token for token what the template renders, the same on every build."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from tiercache.testing.real_model import build_smollm2
from tiercache.tools.conversations import (
    ChatSegments,
    followup_chats,
    mostly_ascii,
    question_chats,
    replay_chats,
    sharegpt_turn_tokens,
)
from tiercache.tools.sharegpt import Conversation, Exchange, read_conversations

USERS, ROUNDS = 4, 3
MAX_PROMPT_TOKENS = 2048


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(build_smollm2())


@pytest.fixture(scope="module")
def conversations() -> list[Conversation]:
    return list(read_conversations())


def rendered_ids(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    """The whole chat rendered by the template and tokenized at once."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_replayed_prompt_is_the_template_s_rendering_and_extends_the_previous(tokenizer: Any,
                                                                                conversations: list) -> None:
    segments = ChatSegments(tokenizer)
    chats = replay_chats(conversations, segments, users=USERS, rounds=ROUNDS, max_prompt_tokens=MAX_PROMPT_TOKENS)
    by_id = {c.id: c for c in conversations}
    for user, conversation_id in enumerate(chats.ids):
        messages = [segments.system_message]
        for round_, exchange in enumerate(by_id[conversation_id].exchanges[:ROUNDS]):
            messages.append({"role": "user", "content": exchange.question})
            prompt = chats.prompt(user, round_)
            assert prompt == rendered_ids(tokenizer, messages, generation=True)
            if round_:
                assert prompt[: len(chats.prompt(user, round_ - 1))] == chats.prompt(user, round_ - 1)
            messages.append({"role": "assistant", "content": exchange.answer})
        assert len(chats.prompt(user, ROUNDS - 1)) <= MAX_PROMPT_TOKENS
    again = replay_chats(conversations, segments, users=USERS, rounds=ROUNDS, max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert again == chats
    assert len(set(chats.ids)) == USERS
    assert [len(row) for row in chats.prompt_tokens()] == [USERS] * ROUNDS


def test_question_chats_hold_the_engine_s_answers(tokenizer: Any, conversations: list) -> None:
    segments = ChatSegments(tokenizer)
    chats = question_chats(conversations, segments, users=USERS, rounds=ROUNDS, question_tokens=(16, 256))
    assert len({question_id for row in chats.ids for question_id in row}) == USERS * ROUNDS
    assert all(16 <= len(question) <= 256 for row in chats.questions for question in row)
    answer = tokenizer("Sure, here it is.", add_special_tokens=False)["input_ids"]
    answers = [[answer] * ROUNDS for _ in range(USERS)]
    second = chats.prompt(2, 1, answers)
    first = chats.prompt(2, 0, answers)
    assert second == first + answer + segments.answer_end + chats.questions[2][1]
    text = tokenizer.decode(second)
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="pass them"):
        chats.prompt(0, 1)
    followups = followup_chats(conversations, segments, users=2, rounds=ROUNDS, question_tokens=(16, 256))
    assert all(len(set(row)) == 1 for row in followups.ids)  # one conversation per user, asked in order


def test_turn_lengths_come_from_the_conversations(conversations: list) -> None:
    words = sharegpt_turn_tokens(conversations, lambda text: len(text.split()), users=3, rounds=2,
                                 max_message_tokens=50)
    chosen = [c for c in conversations if len(c.exchanges) >= 2 and mostly_ascii(c)][:3]
    assert words == tuple(tuple((min(len(e.question.split()), 50), min(len(e.answer.split()), 50))
                                for e in c.exchanges[:2]) for c in chosen)
    with pytest.raises(ValueError, match="only 0 conversations"):
        sharegpt_turn_tokens([], len, users=1, rounds=1, max_message_tokens=1)


def test_mostly_ascii() -> None:
    assert mostly_ascii(Conversation("en", (Exchange("What is KV?", "Keys and values."),)))
    assert not mostly_ascii(Conversation("zh", (Exchange("什么是缓存？", "缓存是存储。"),)))
