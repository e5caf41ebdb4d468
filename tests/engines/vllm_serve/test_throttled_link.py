"""A restart over a slow link: an adaptive reader behind 100 Mbit/s reads every block at a lossy level.

A writer (``codec: {levels: [compact, int8, exact]}``, straight to Redis) stores
three copies of every block of two long prompts; a fresh server whose Redis URL
is a ``ThrottledLink`` at 100 Mbit/s (``codec: {levels: [exact, int8, compact],
adaptive: true}``) answers the same prompts. Over that link an exact block takes
about four times an int8 one, so the reader's measured link sends no chunk
exact: every reusable block is loaded, at int8 or compact (their split follows
the decode rates this machine measures, so it is recorded, not asserted). The
answers are lossy: recorded, never asserted equal.
"""

from __future__ import annotations

from collections.abc import Iterator
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
from tiercache.testing.throttled_link import ThrottledLink
from tiercache.testing.tiny_llama import random_prompt_ids

PROMPTS = {"slow_a": random_prompt_ids(1400, seed=921), "slow_b": random_prompt_ids(1000, seed=922)}
ANSWER_TOKENS = 8
BLOCK = 32
LINK_BITS_PER_S = 100e6


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_store(tmp_path_factory.mktemp("slow-link-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def slow_reader(model_dirs: dict[str, Path], logs: Path, store: RedisServer,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the writer stored, and what the reader behind the throttled link loaded and answered."""
    tables = str(compact_tables(model_dirs["seed0"], tmp_path_factory.mktemp("slow-tables") / "tiny-llama.npz"))
    writer_line = redis_config(store.url, codec={"levels": ["compact", "int8", "exact"], "tables": tables})
    with serving(model_dirs["seed0"], logs / "slow_link_writer.log", kv_transfer_config=writer_line) as writer:
        written = {name: writer.complete(prompt, max_tokens=ANSWER_TOKENS).token_ids
                   for name, prompt in PROMPTS.items()}
        stored = round(settled(writer).total("vllm:tiercache_stored_blocks_total"))
        assert wait_until(lambda: int(store.cli("DBSIZE")) == 3 * stored, timeout_s=60), "three copies of each block"
    adaptive = {"levels": ["exact", "int8", "compact"], "adaptive": True, "tables": tables}
    with ThrottledLink(("127.0.0.1", store.port), LINK_BITS_PER_S, 0.0) as link, serving(
        model_dirs["copy"], logs / "slow_link_reader.log", kv_transfer_config=redis_config(link.url, codec=adaptive)
    ) as reader, Counted(reader) as seen:
        answers = {name: reader.complete(prompt, max_tokens=ANSWER_TOKENS).token_ids
                   for name, prompt in PROMPTS.items()}
    levels = {level: seen.tiercache("level_blocks", level=level) for level in ("exact", "int8", "compact")}
    print(f"behind {LINK_BITS_PER_S / 1e6:.0f} Mbit/s the adaptive reader read {levels}; answers equal to the "
          f"writer's: {answers == written}")
    return {"levels": levels, "external": seen.external, "loaded": seen.tiercache("loaded_blocks"),
            "answers": answers, "problems": log_problems(reader)}


def test_an_adaptive_reader_behind_a_slow_link_loads_every_block_and_none_exact(slow_reader: dict[str, Any]) -> None:
    blocks = sum(reusable(len(prompt)) // BLOCK for prompt in PROMPTS.values())
    levels = slow_reader["levels"]
    assert slow_reader["external"] == blocks * BLOCK and slow_reader["loaded"] == blocks
    assert levels["exact"] == 0, "over 100 Mbit/s an exact block costs four int8 ones"
    assert levels["int8"] + levels["compact"] == blocks
    assert all(len(answer) == ANSWER_TOKENS for answer in slow_reader["answers"].values())
    assert slow_reader["problems"] == []
