"""A restart over Redis from lossy values: ``codec: {levels: [int8]}`` or ``{levels: [compact], tables: ...}`` in
the connector's config line.

For each level, three fresh ``vllm serve`` processes of the small Llama, one
after the other, over one real ``redis-server``: server 1 answers long prompts
and stores every block at the level (int8: its pages as groups of ``head_size``
elements, a float16 scale each; compact: its K/V read through the token map of
vLLM's CPU kernel, tables learned here on the model's own K/V of other prompts);
server 2 (the same line) answers the same prompts loading those values; server 3
(no codec: an exact reader) loads none of them and recomputes. The answers are
lossy, so they are recorded (in the logs' folder, with the first token where
each differs from the exact server's), never asserted equal.
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
    compact_tables,
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

PROMPTS = {"lossy_a": random_prompt_ids(1500, seed=901), "lossy_b": random_prompt_ids(1100, seed=902)}
"""This module's own prompts (lossy answers are not the session baseline's to compare)."""
ANSWER_TOKENS = 16
BLOCK = 32


@dataclass(frozen=True)
class Served:
    """What one server answered and counted while it answered ``PROMPTS``."""

    answers: dict[str, list[int]]
    external: int
    loaded_blocks: int
    level_blocks: int
    """Blocks the remotes served at the module's level."""
    stored_blocks: int
    problems: list[str]


@pytest.fixture(scope="module", params=["int8", "compact"])
def level(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def codec(level: str, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The connector's ``codec`` for ``level`` (compact: tables learned on the model's own K/V of other prompts)."""
    if level == "int8":
        return {"levels": ["int8"]}
    tables = compact_tables(model_dirs["seed0"], tmp_path_factory.mktemp("compact-tables") / "tiny-llama.npz")
    return {"levels": ["compact"], "tables": str(tables)}


def answer_all(server: VllmServer, level: str) -> Served:
    """Every prompt answered once, with what the server counted meanwhile."""
    with Counted(server) as seen:
        answers = {name: server.complete(prompt, max_tokens=ANSWER_TOKENS).token_ids
                   for name, prompt in PROMPTS.items()}
    metrics = settled(server)
    return Served(answers, seen.external, seen.tiercache("loaded_blocks"),
                  seen.tiercache("level_blocks", level=level),
                  round(metrics.total("vllm:tiercache_stored_blocks_total")), log_problems(server))


@pytest.fixture(scope="module")
def store(level: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_store(tmp_path_factory.mktemp(f"{level}-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def servers(level: str, codec: dict[str, Any], model_dirs: dict[str, Path], logs: Path,
            store: RedisServer) -> dict[str, Served]:
    """Server 1 (the level) writes; a fresh server 2 (the level) and a fresh server 3 (exact) answer the same
    prompts."""
    served = {}
    line = redis_config(store.url, codec=codec)
    with serving(model_dirs["seed0"], logs / f"{level}_writer.log", kv_transfer_config=line) as one:
        served["writer"] = answer_all(one, level)
        metrics: ServerMetrics = settled(one)
        stored = round(metrics.total("vllm:tiercache_stored_blocks_total"))
        served_keys = wait_until(lambda: int(store.cli("DBSIZE")) == stored, timeout_s=30)
        assert served_keys, f"Redis holds {store.cli('DBSIZE')} values of the {stored} blocks stored"
    with serving(model_dirs["copy"], logs / f"{level}_reader.log", kv_transfer_config=line) as two:
        served["lossy"] = answer_all(two, level)
    with serving(model_dirs["copy"], logs / f"{level}_exact_reader.log",
                 kv_transfer_config=redis_config(store.url)) as three:
        served["exact"] = answer_all(three, level)
    (logs / f"{level}_answers.json").write_text(json.dumps({name: s.answers for name, s in served.items()}, indent=1))
    for name, answer in served["lossy"].answers.items():  # shown with -rP, or when a test fails
        exact = served["exact"].answers[name]
        first = next((i for i, (a, b) in enumerate(zip(answer, exact, strict=True)) if a != b), None)
        said = "equals the exact answer" if first is None else f"differs from token {first}"
        print(f"{name}: {level} restart {said}")
    return served


def test_the_writer_stores_one_value_a_block_at_its_level_and_loads_nothing(servers: dict[str, Served]) -> None:
    writer = servers["writer"]
    assert writer.stored_blocks >= sum(len(prompt) // BLOCK for prompt in PROMPTS.values())
    assert (writer.external, writer.loaded_blocks, writer.level_blocks) == (0, 0, 0)
    assert writer.problems == []


def test_a_fresh_server_of_the_same_line_loads_every_reusable_block_at_its_level(servers: dict[str, Served]) -> None:
    reader = servers["lossy"]
    blocks = sum(reusable(len(prompt)) // BLOCK for prompt in PROMPTS.values())
    assert reader.external == blocks * BLOCK
    assert reader.loaded_blocks == blocks == reader.level_blocks, "every block loaded was read at the level"
    assert all(len(answer) == ANSWER_TOKENS for answer in reader.answers.values())
    assert reader.problems == []


def test_a_fresh_exact_server_loads_none_of_the_lossy_values(servers: dict[str, Served]) -> None:
    exact = servers["exact"]
    assert (exact.external, exact.loaded_blocks, exact.level_blocks) == (0, 0, 0), "an exact reader recomputes"
    assert exact.answers == servers["writer"].answers, "recomputed: the writer's exact answers"
    assert exact.problems == []
