"""A remote that is down, stopped or serving garbage, under vLLM's real tiering manager.

Each case must end as misses or failed jobs (vLLM recomputes), never an
exception into the scheduler and never wrong KV, with the manager consistent
afterwards: nothing pending once drained, and every primary chunk free again
(no leaked pins).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

from tiercache.integrations.vllm import TierCacheTier
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_offloading import (
    SETTLE_S,
    Engine,
    chunk_keys,
    offloading_config,
    payloads,
    redis_topology,
    tier_config,
)

COUNT = 6


def stored(server: RedisServer, engines: list[Engine], seed: int = 0) -> tuple[list[OffloadKey], list[bytes]]:
    """COUNT chunks cascaded into ``server`` by one engine (then shut down)."""
    writer = Engine(offloading_config([tier_config(redis_topology(server))]))
    engines.append(writer)
    keys = chunk_keys(COUNT, f"prompt-{seed}")
    data = payloads(COUNT, writer.row_bytes, seed)
    writer.store(keys, data)
    writer.settle()
    return keys, data


def fresh(server: RedisServer, engines: list[Engine]) -> Engine:
    engine = Engine(offloading_config([tier_config(redis_topology(server))]))
    engines.append(engine)
    return engine


def consistent(engine: Engine) -> None:
    """Drained, nothing pending, no chunk of the primary pinned."""
    engine.settle()
    with engine.manager.lock:
        assert not engine.manager.has_pending_work()
        assert not engine.manager._jobs
    assert engine.all_chunks_free()


@contextlib.contextmanager
def faulted(server: RedisServer, fault: str) -> Iterator[None]:
    """The server killed or SIGSTOPped for the block (a stopped one is continued afterwards)."""
    getattr(server, fault)()
    try:
        yield
    finally:
        if fault == "stop":
            server.cont()


def tier_of(engine: Engine) -> TierCacheTier:
    (tier,) = engine.tiers
    assert isinstance(tier, TierCacheTier)
    return tier


def counters(engine: Engine) -> dict[str, int]:
    return tier_of(engine).store.counters()


def redis_key(engine: Engine, key: OffloadKey) -> str:
    """The Redis key under which the engine's tier keeps a chunk."""
    store = tier_of(engine).store
    return store.tiers[0].redis_key(store.key(key)).decode()


def until_promoting(engine: Engine, keys: list[OffloadKey], ctx: ReqContext) -> None:
    """Look up (stepping) until every key's promotion has been initiated (HIT_PENDING), not yet loaded."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        with engine.manager.lock:
            results = [engine.manager.lookup(key, ctx) for key in keys]
        if results == [LookupResult.HIT_PENDING] * len(keys):
            return
        assert results == [LookupResult.RETRY] * len(keys) and time.monotonic() < deadline, results
        engine.step()  # sends the presence check; the one step that would also submit the loads is the test's
        time.sleep(0.005)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_server_down_or_stopped_before_the_lookup_is_a_miss(
    redis_server: RedisServer, engines: list[Engine], fault: str
) -> None:
    keys, _ = stored(redis_server, engines)
    reader = fresh(redis_server, engines)
    with faulted(redis_server, fault):
        assert reader.read(keys) == [None] * COUNT
        assert counters(reader)["presence_unknown"] >= 1
        consistent(reader)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_server_lost_between_the_hit_and_the_load_fails_the_job_and_the_chunks_miss(
    redis_server: RedisServer, engines: list[Engine], fault: str
) -> None:
    keys, _ = stored(redis_server, engines)
    reader = fresh(redis_server, engines)
    ctx = reader.context()
    with reader.manager.lock:
        reader.manager.on_new_request(ctx)
    until_promoting(reader, keys, ctx)
    with faulted(redis_server, fault):
        assert reader.lookup(keys, ctx) == 0, "a failed promotion is a miss, not a retry forever"
        with reader.manager.lock:
            reader.manager.on_request_finished(ctx)
        assert counters(reader)["read_misses"] == COUNT
        consistent(reader)


def test_a_corrupted_chunk_fails_alone_and_its_neighbours_arrive_byte_exact(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    keys, data = stored(redis_server, engines)
    reader = fresh(redis_server, engines)
    bad = 2
    length = int(redis_server.cli("STRLEN", redis_key(reader, keys[bad])))
    redis_server.cli("SETRANGE", redis_key(reader, keys[bad]), str(length - 8), "corrupt!")
    found = reader.read(keys)
    assert found == [*data[:bad], *[None] * (COUNT - bad)], "the prefix up to the bad chunk, byte-exact"
    assert counters(reader)["read_misses"] == 1
    assert reader.read(keys) == found, "the bad chunk stays a miss; the loaded ones stay in the primary"
    consistent(reader)


def test_garbage_under_every_key_is_a_miss_and_never_reaches_the_primary(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    keys, _ = stored(redis_server, engines)
    reader = fresh(redis_server, engines)
    for key in keys:
        redis_server.cli("SET", redis_key(reader, key), "garbage")
    assert reader.read(keys) == [None] * COUNT
    consistent(reader)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_cascade_into_a_lost_server_fails_and_unpins_the_primary(
    redis_server: RedisServer, engines: list[Engine], fault: str
) -> None:
    writer = fresh(redis_server, engines)
    with faulted(redis_server, fault):
        keys = chunk_keys(COUNT, "lost")
        data = payloads(COUNT, writer.row_bytes, seed=9)
        writer.store(keys, data)
        writer.settle()
        assert counters(writer)["writes_failed"] == COUNT
        assert writer.read(keys) == data, "vLLM's CPU tier still serves what it holds"
        consistent(writer)
