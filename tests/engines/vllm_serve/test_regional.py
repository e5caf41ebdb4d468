"""README's regional line: a server in region A writes, a server in region B (a fresh process) loads with
``force_latest``, reading through to central and back-filling its region; answers equal the baseline's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.vllm_serving import (
    BLOCK,
    MAX_TOKENS,
    PROMPTS,
    Counted,
    ask,
    log_problems,
    redis_store,
    regional_config,
    reusable,
    serving,
    settled,
    wait_until,
)

from tiercache.testing.redis_servers import RedisServer

STEADY_S = 1.0
"""How long central's key count must hold still to count replication as finished."""


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RedisServer]]:
    with (redis_store(tmp_path_factory.mktemp("central")) as central,
          redis_store(tmp_path_factory.mktemp("region-a")) as region_a,
          redis_store(tmp_path_factory.mktemp("region-b")) as region_b):
        yield {"central": central, "a": region_a, "b": region_b}


def _dbsize(server: RedisServer) -> int:
    return int(server.cli("DBSIZE"))


def _steady(server: RedisServer) -> bool:
    """Whether ``server`` holds keys and their count stays put for ``STEADY_S``."""
    before = _dbsize(server)
    return before > 0 and not wait_until(lambda: _dbsize(server) != before, timeout_s=STEADY_S)


def test_region_b_loads_what_region_a_wrote(model_dirs: dict[str, Path], logs: Path,
                                              baseline: dict[str, list[int]], sites: dict[str, RedisServer]):
    central = sites["central"]
    config = regional_config(sites["a"].url, central.url)
    with serving(model_dirs["seed0"], logs / "region-a.log", kv_transfer_config=config) as writer:
        assert ask(writer, "regional") == baseline["regional"]
        assert wait_until(lambda: _steady(central), timeout_s=30)  # replicated to central
        stored = round(settled(writer).total("vllm:tiercache_stored_blocks_total"))
        assert log_problems(writer) == []
    assert stored == (len(PROMPTS["regional"]) + MAX_TOKENS["regional"] - 1) // BLOCK  # the KV computed, whole blocks
    assert _dbsize(sites["b"]) == 0
    config = regional_config(sites["b"].url, central.url)
    with serving(model_dirs["seed0"], logs / "region-b.log", kv_transfer_config=config) as reader:
        with Counted(reader) as seen:
            answer = ask(reader, "regional")
        problems = log_problems(reader)
    assert answer == baseline["regional"]
    whole = reusable(len(PROMPTS["regional"]))
    assert seen.external == whole
    assert seen.tiercache("hit_blocks", tier="regional") == whole // BLOCK
    assert _dbsize(sites["b"]) > 0  # the read back-filled region B
    assert problems == []
