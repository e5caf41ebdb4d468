"""The trained chat model (SmolLM2-135M-Instruct, dequantized from its GGUF) served by ``vllm serve`` with the
connector: a restart served from Redis answers a real question with the text vLLM alone gives, a sensible one, and a
chat's next turn reuses the first.

The prompt is a ShareGPT conversation's first exchange (its recorded answer
included) followed by a question of ours, through the model's chat template.
Three servers, one after the other: vLLM alone without its prefix cache (the
reference), a server over Redis that answers and stores, and a fresh one over
the same Redis with vLLM's prefix cache off, so every reused token comes through
the connector. Answers stop at the model's end of turn (float32, greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from support.vllm_serving import (
    Counted,
    log_problems,
    redis_config,
    redis_store,
    reusable,
    serving,
    settled,
    wait_until,
)
from transformers import AutoTokenizer

from tiercache.testing.real_model import build_smollm2
from tiercache.testing.vllm_server import VllmServer
from tiercache.tools.conversations import ChatSegments, replay_chats
from tiercache.tools.sharegpt import read_conversations

QUESTION = "What is the capital of France? Answer in one sentence."
FOLLOW_UP = "Which river flows through that city?"
ANSWER_TOKENS = 32
"""At most; answers end at the model's end of turn."""
MAX_OPENING_TOKENS = 1024
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)


@dataclass(frozen=True)
class Chat:
    """The two turns' prompts (the second made from the reference's first answer) and the reference's answers."""

    first: list[int]
    second: list[int]
    answers: tuple[list[int], list[int]]
    text: str
    """The reference's first answer, as text."""


@dataclass(frozen=True)
class Restarted:
    """What the restarted server answered, and the tokens the connector supplied for each turn."""

    answers: tuple[list[int], list[int]]
    external: tuple[int, int]
    local: tuple[int, int]
    problems: list[str]


def answer(server: VllmServer, prompt: list[int]) -> list[int]:
    """The greedy answer, ending at the model's end of turn (or after ``ANSWER_TOKENS``)."""
    return server.complete(prompt, max_tokens=ANSWER_TOKENS, ignore_eos=False).token_ids


@pytest.fixture(scope="module")
def model() -> Path:
    return build_smollm2()


@pytest.fixture(scope="module")
def chat(model: Path, logs: Path) -> Chat:
    tokenizer = AutoTokenizer.from_pretrained(model)
    segments = ChatSegments(tokenizer)
    replay = replay_chats(read_conversations(), segments, users=1, rounds=2, max_prompt_tokens=MAX_OPENING_TOKENS)
    first = replay.prompt(0, 1)[: -len(replay.questions[0][1])] + segments.question(QUESTION)
    with serving(model, logs / "real-reference.log", args=NO_PREFIX_CACHE) as server:
        one = answer(server, first)
        said = [token for token in one if token != tokenizer.eos_token_id]
        second = first + said + segments.answer_end + segments.question(FOLLOW_UP)
        two = answer(server, second)
    return Chat(first, second, (one, two), tokenizer.decode(one, skip_special_tokens=True))


@pytest.fixture(scope="module")
def restarted(model: Path, logs: Path, chat: Chat, tmp_path_factory: pytest.TempPathFactory) -> Restarted:
    with redis_store(tmp_path_factory.mktemp("real-redis")) as redis:
        config = redis_config(redis.url)
        with serving(model, logs / "real-first.log", kv_transfer_config=config) as server:
            answer(server, chat.first)
            stored = settled(server).total("vllm:tiercache_stored_blocks_total")
            assert stored > 0 and wait_until(lambda: int(redis.cli("DBSIZE")) == stored, timeout_s=30)
        with serving(model, logs / "real-restarted.log", kv_transfer_config=config, args=NO_PREFIX_CACHE) as server:
            with Counted(server) as first:
                one = answer(server, chat.first)
            with Counted(server) as second:
                two = answer(server, chat.second)
            problems = log_problems(server)
    return Restarted((one, two), (first.external, second.external), (first.local, second.local), problems)


def test_the_model_answers_sensibly(chat: Chat) -> None:
    assert "Paris" in chat.text, chat.text


def test_a_restart_served_from_redis_answers_as_vllm_alone(chat: Chat, restarted: Restarted) -> None:
    assert restarted.external[0] == reusable(len(chat.first))
    assert restarted.local == (0, 0)
    assert restarted.answers[0] == chat.answers[0]
    assert restarted.problems == []


def test_a_chat_s_next_turn_reuses_the_first(chat: Chat, restarted: Restarted) -> None:
    assert restarted.external[1] >= reusable(len(chat.first))
    assert restarted.external[1] <= reusable(len(chat.second))
    assert restarted.answers[1] == chat.answers[1]
