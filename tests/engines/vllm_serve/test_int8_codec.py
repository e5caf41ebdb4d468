"""A restart over Redis from int8 values: ``codec: {levels: [int8]}`` in the connector's config line.

Three fresh ``vllm serve`` processes of the small Llama, one after the other,
over one real ``redis-server``: server 1 (int8) answers long prompts and stores
every block as an int8 value (its pages as groups of ``head_size`` elements, a
float16 scale each); server 2 (int8 too) answers the same prompts loading those
values; server 3 (no codec: an exact reader) loads none of them and recomputes.
The answers are lossy, so they are recorded (in the logs' folder, and compared
with the exact server's), never asserted equal.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.server_formats import ServerMetrics
from tiercache.testing.tiny_llama import random_prompt_ids
from tiercache.testing.vllm_server import VllmServer

CODEC = {"levels": ["int8"]}
PROMPTS = {"int8_a": random_prompt_ids(1500, seed=901), "int8_b": random_prompt_ids(1100, seed=902)}
"""This module's own prompts (lossy answers are not the session baseline's to compare)."""
ANSWER_TOKENS = 16
BLOCK = 32


@dataclass(frozen=True)
class Served:
    """What one server answered and counted while it answered ``PROMPTS``."""

    answers: dict[str, list[int]]
    external: int
    loaded_blocks: int
    int8_blocks: int
    stored_blocks: int
    problems: list[str]


def int8_config(url: str) -> dict[str, Any]:
    """The README's Redis line with ``codec: {levels: [int8]}``."""
    config = redis_config(url)
    config["kv_connector_extra_config"]["codec"] = CODEC
    return config


def answer_all(server: VllmServer) -> Served:
    """Every prompt answered once, with what the server counted meanwhile."""
    with Counted(server) as seen:
        answers = {name: server.complete(prompt, max_tokens=ANSWER_TOKENS).token_ids
                   for name, prompt in PROMPTS.items()}
    metrics = settled(server)
    return Served(answers, seen.external, seen.tiercache("loaded_blocks"),
                  seen.tiercache("level_blocks", level="int8"),
                  round(metrics.total("vllm:tiercache_stored_blocks_total")), log_problems(server))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_store(tmp_path_factory.mktemp("int8-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def servers(model_dirs: dict[str, Path], logs: Path, store: RedisServer) -> dict[str, Served]:
    """Server 1 (int8) writes; a fresh server 2 (int8) and a fresh server 3 (exact) answer the same prompts."""
    served = {}
    with serving(model_dirs["seed0"], logs / "int8_writer.log", kv_transfer_config=int8_config(store.url)) as one:
        served["writer"] = answer_all(one)
        metrics: ServerMetrics = settled(one)
        stored = round(metrics.total("vllm:tiercache_stored_blocks_total"))
        served_keys = wait_until(lambda: int(store.cli("DBSIZE")) == stored, timeout_s=30)
        assert served_keys, f"Redis holds {store.cli('DBSIZE')} values of the {stored} blocks stored"
    with serving(model_dirs["copy"], logs / "int8_reader.log", kv_transfer_config=int8_config(store.url)) as two:
        served["int8"] = answer_all(two)
    with serving(model_dirs["copy"], logs / "exact_reader.log", kv_transfer_config=redis_config(store.url)) as three:
        served["exact"] = answer_all(three)
    (logs / "int8_answers.json").write_text(json.dumps({name: s.answers for name, s in served.items()}, indent=1))
    for name, answer in served["int8"].answers.items():  # shown with -rP, or when a test fails
        exact = served["exact"].answers[name]
        first = next((i for i, (a, b) in enumerate(zip(answer, exact, strict=True)) if a != b), None)
        print(f"{name}: int8 restart {'equals the exact answer' if first is None else f'differs from token {first}'}")
    return served


def test_the_writer_stores_one_int8_value_a_block_and_loads_nothing(servers: dict[str, Served]) -> None:
    writer = servers["writer"]
    assert writer.stored_blocks >= sum(len(prompt) // BLOCK for prompt in PROMPTS.values())
    assert (writer.external, writer.loaded_blocks, writer.int8_blocks) == (0, 0, 0)
    assert writer.problems == []


def test_a_fresh_int8_server_loads_every_reusable_block_from_int8_values(servers: dict[str, Served]) -> None:
    reader = servers["int8"]
    blocks = sum(reusable(len(prompt)) // BLOCK for prompt in PROMPTS.values())
    assert reader.external == blocks * BLOCK
    assert reader.loaded_blocks == blocks == reader.int8_blocks, "every block loaded was read as int8"
    assert all(len(answer) == ANSWER_TOKENS for answer in reader.answers.values())
    assert reader.problems == []


def test_a_fresh_exact_server_loads_none_of_the_int8_values(servers: dict[str, Served]) -> None:
    exact = servers["exact"]
    assert (exact.external, exact.loaded_blocks, exact.int8_blocks) == (0, 0, 0), "an exact reader recomputes"
    assert exact.answers == servers["writer"].answers, "recomputed: the writer's exact answers"
    assert exact.problems == []
