"""RemoteStore, the public remote-only core API: real redis-servers, engine-owned keys and buffers.

What it must hold: a write from one store is read byte-exact by another store of
the same namespace and never by another namespace; presence checks are three-valued (a
server that is down or stopped is UNKNOWN, never ABSENT); a slower tier's hit is
written back into the faster one; garbage is a miss that leaves nothing wrong in
the caller's buffer; writes past the bound fail at once; close is bounded; a bad
topology names the file, the field and the expectation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from support import REPO

from tiercache.blocks.keys import Namespace
from tiercache.config import ConfigError
from tiercache.config.remote import load_remote_topology, remote_topology_from_dict
from tiercache.remote.store import RemoteStore
from tiercache.testing.redis_servers import RedisServer, empty_dests, random_blocks
from tiercache.tiers.base import Presence

BLOCK_BYTES = 4096
COUNT = 8
WAIT_S = 10.0
NAMESPACE = Namespace("test-model", "fp16:4096:tp1", tp_rank=0)


def topology(*servers: RedisServer, **queues: object) -> dict:
    tiers = [
        {"name": f"redis{i}", "type": "redis", "options": {"url": s.url, "allow_unbounded": True, "timeout_s": 0.3}}
        for i, s in enumerate(servers)
    ]
    return {"tiers": tiers, "queues": {"remote_lookup_timeout_ms": 150, **queues}}


def store_of(data: dict, namespace: Namespace = NAMESPACE, **kwargs: object) -> RemoteStore:
    store = RemoteStore(remote_topology_from_dict(data), namespace, BLOCK_BYTES, **kwargs)  # type: ignore[arg-type]
    store.start()
    return store


def engine_keys(count: int, seed: int = 0) -> list[bytes]:
    return [f"engine-block-{seed}-{i}".encode() for i in range(count)]


def test_a_write_is_read_byte_exact_by_another_store_of_the_namespace_only(redis_server: RedisServer) -> None:
    writer, reader = store_of(topology(redis_server)), store_of(topology(redis_server))
    other_model = store_of(topology(redis_server), Namespace("other-model", "fp16:4096:tp1"))
    other_rank = store_of(topology(redis_server), Namespace("test-model", "fp16:4096:tp1", tp_rank=1))
    try:
        _, payloads = random_blocks(COUNT, BLOCK_BYTES, seed=3)
        keys = [writer.key(k) for k in engine_keys(COUNT)]
        assert writer.write(keys, payloads).result(WAIT_S) == [True] * COUNT

        assert [reader.key(k) for k in engine_keys(COUNT)] == keys, "one namespace, one key per engine key"
        found = reader.contains(keys).result(WAIT_S)
        assert [(f.presence, f.tier) for f in found] == [(Presence.HELD, 0)] * COUNT
        dests = empty_dests(COUNT, BLOCK_BYTES)
        assert reader.read(keys, dests).result(WAIT_S) == [True] * COUNT
        assert [bytes(d) for d in dests] == [bytes(p) for p in payloads]

        by_engine_key = empty_dests(COUNT, BLOCK_BYTES)  # the mapping done on the store's loop is the same
        assert reader.read(engine_keys(COUNT), by_engine_key, engine_keys=True).result(WAIT_S) == [True] * COUNT
        assert [bytes(d) for d in by_engine_key] == [bytes(p) for p in payloads]
        assert reader.keys(engine_keys(COUNT)) == keys
        for other in (other_model, other_rank):
            their_keys = [other.key(k) for k in engine_keys(COUNT)]
            assert set(their_keys).isdisjoint(keys)
            assert {f.presence for f in other.contains(their_keys).result(WAIT_S)} == {Presence.ABSENT}
            # Even asked for this namespace's keys, another namespace's codec refuses the values.
            assert other.read(keys, empty_dests(COUNT, BLOCK_BYTES)).result(WAIT_S) == [False] * COUNT
        again = empty_dests(COUNT, BLOCK_BYTES)  # and left them in place: no reader proved them damaged
        assert reader.read(keys, again).result(WAIT_S) == [True] * COUNT
        assert [bytes(d) for d in again] == [bytes(p) for p in payloads]
        assert reader.counters()["read_hits_redis0"] == 3 * COUNT
    finally:
        for store in (writer, reader, other_model, other_rank):
            store.close()


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_server_down_or_stopped_is_unknown_and_a_miss_never_an_exception(
    redis_server: RedisServer, fault: str
) -> None:
    store = store_of(topology(redis_server))
    try:
        keys = [store.key(k) for k in engine_keys(COUNT)]
        _, payloads = random_blocks(COUNT, BLOCK_BYTES)
        assert store.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        getattr(redis_server, fault)()
        found = store.contains(keys).result(WAIT_S)
        assert {f.presence for f in found} == {Presence.UNKNOWN}, "could not tell is not 'absent'"
        assert all(f.tier is None for f in found)
        assert store.read(keys, empty_dests(COUNT, BLOCK_BYTES)).result(WAIT_S) == [False] * COUNT
        assert store.write(keys, payloads).result(WAIT_S) == [False] * COUNT
        assert store.counters()["presence_unknown"] == COUNT
    finally:
        if fault == "stop":
            redis_server.cont()
        started = time.monotonic()
        store.close()
        assert time.monotonic() - started < WAIT_S


def test_corrupted_values_are_misses_and_never_reach_the_buffer_as_kv(redis_server: RedisServer) -> None:
    store = store_of(topology(redis_server))
    try:
        keys = [store.key(k) for k in engine_keys(COUNT)]
        _, payloads = random_blocks(COUNT, BLOCK_BYTES)
        assert store.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        tier = store.tiers[0]
        redis_server.cli("SET", tier.redis_key(keys[0]).decode(), "garbage")
        length = int(redis_server.cli("STRLEN", tier.redis_key(keys[1]).decode()))
        redis_server.cli("SETRANGE", tier.redis_key(keys[1]).decode(), str(length - 3), "xyz")
        dests = empty_dests(COUNT, BLOCK_BYTES)
        oks = store.read(keys, dests).result(WAIT_S)
        assert oks == [False, False] + [True] * (COUNT - 2)
        assert [bytes(d) for d in dests[2:]] == [bytes(p) for p in payloads[2:]]
    finally:
        store.close()


def test_a_slower_tiers_hit_is_written_back_into_the_faster_one(redis_factory: Callable[..., RedisServer]) -> None:
    fast, slow = redis_factory(), redis_factory()
    both, slow_only, fast_only = (
        store_of(topology(fast, slow)),
        store_of(topology(slow)),
        store_of(topology(fast)),
    )
    try:
        keys = [both.key(k) for k in engine_keys(COUNT)]
        _, payloads = random_blocks(COUNT, BLOCK_BYTES, seed=5)
        assert slow_only.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        found = both.contains(keys).result(WAIT_S)
        assert [(f.presence, f.tier) for f in found] == [(Presence.HELD, 1)] * COUNT
        dests = empty_dests(COUNT, BLOCK_BYTES)
        assert both.read(keys, dests).result(WAIT_S) == [True] * COUNT
        assert [bytes(d) for d in dests] == [bytes(p) for p in payloads]
        for dest in dests:  # the caller reuses its buffers at once: the write-back has its own copy
            dest[:] = bytes(BLOCK_BYTES)
        deadline = time.monotonic() + WAIT_S
        while both.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        again = empty_dests(COUNT, BLOCK_BYTES)
        assert fast_only.read(keys, again).result(WAIT_S) == [True] * COUNT
        assert [bytes(d) for d in again] == [bytes(p) for p in payloads]
        assert both.counters()["read_hits_redis1"] == COUNT
        assert both.stats()["tiers"]["redis0"]["put_checksums_carried"] == COUNT, "hashed once, from the fresh copy"
    finally:
        for store in (both, slow_only, fast_only):
            store.close()


def test_a_write_to_several_tiers_hashes_each_block_once(redis_factory: Callable[..., RedisServer]) -> None:
    """Two lanes share one checksum per block (each tier would hash it otherwise); one lane hashes in its tier."""
    first, second = redis_factory(), redis_factory()
    both, alone = store_of(topology(first, second)), store_of(topology(first))
    try:
        keys = [both.key(k) for k in engine_keys(COUNT, seed=9)]
        _, payloads = random_blocks(COUNT, BLOCK_BYTES, seed=9)
        assert both.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        tiers = both.stats()["tiers"]
        assert tiers["redis0"]["put_checksums_carried"] == tiers["redis1"]["put_checksums_carried"] == COUNT
        assert alone.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        assert "put_checksums_carried" not in alone.stats()["tiers"]["redis0"]
        for store in (both, alone):
            dests = empty_dests(COUNT, BLOCK_BYTES)
            assert store.read(keys, dests).result(WAIT_S) == [True] * COUNT
            assert [bytes(d) for d in dests] == [bytes(p) for p in payloads]
    finally:
        both.close()
        alone.close()


def test_writes_past_the_bound_fail_at_once_and_close_is_bounded(redis_server: RedisServer) -> None:
    store = store_of(topology(redis_server, max_pending_stores=COUNT), record_events=True)
    try:
        keys = [store.key(k) for k in engine_keys(3 * COUNT)]
        _, payloads = random_blocks(3 * COUNT, BLOCK_BYTES)
        redis_server.stop()
        first = store.write(keys[:COUNT], payloads[:COUNT])
        second = store.write(keys[COUNT:], payloads[COUNT:])
        assert second.done() and second.result() == [False] * (2 * COUNT), "past the bound: failed at once"
        assert store.counters()["writes_dropped"] == 2 * COUNT
        redis_server.cont()
        assert first.result(WAIT_S) == [True] * COUNT
        events = store.take_events()
        assert [(e.tier, set(e.keys)) for e in events] == [("redis0", set(keys[:COUNT]))]
        assert store.take_events() == []
        big = store.write(keys, payloads)  # nothing else in flight: one batch past the bound is taken
        assert big.result(WAIT_S) == [True] * (3 * COUNT)
        redis_server.stop()
        store.write(keys[COUNT:], payloads[COUNT:])
        started = time.monotonic()
    finally:
        store.close()
        redis_server.cont()
    assert time.monotonic() - started < WAIT_S


def test_buffers_of_the_wrong_size_are_refused_before_anything_moves(redis_server: RedisServer) -> None:
    store = store_of(topology(redis_server))
    try:
        with pytest.raises(ValueError, match="4096"):
            store.write([store.key(b"k")], [memoryview(bytearray(BLOCK_BYTES - 1))])
        with pytest.raises(ValueError, match="2 buffers"):
            store.read([store.key(b"k")], empty_dests(2, BLOCK_BYTES))
    finally:
        store.close()


def test_a_closed_or_unstarted_store_answers_failures_as_values(redis_server: RedisServer) -> None:
    store = RemoteStore(remote_topology_from_dict(topology(redis_server)), NAMESPACE, BLOCK_BYTES)
    key = store.key(b"k")
    assert store.read([key], empty_dests(1, BLOCK_BYTES)).result() == [False]
    assert store.contains([key]).result()[0].presence is Presence.UNKNOWN
    store.start()
    store.close()
    assert store.write([key], empty_dests(1, BLOCK_BYTES)).result() == [False]


@pytest.mark.parametrize(
    ("document", "field", "expected"),
    [
        ({"tiers": [{"type": "cpu", "capacity_blocks": 4}]}, "tiers[0].type", "a remote tier type"),
        ({"tiers": [{"type": "redis", "write_policy": "write_back"}]}, "tiers[0].write_policy", "write_through"),
        ({"tiers": []}, "tiers", "a non-empty list"),
        ({"tiers": [{"type": "redis"}], "layout": {}}, "layout", "one of the known fields"),
        ({"tiers": [{"type": "redis"}], "model": {"id": "m"}}, "model.id", "one of the known fields"),
        ({"tiers": [{"type": "redis", "options": {"ur": "x"}}]}, "tiers[0].options.ur", "did you mean 'url'"),
        ({"tiers": [{"type": "redis"}, {"type": "redis"}]}, "tiers[1].name", "not used by another tier"),
    ],
)
def test_a_bad_remote_topology_names_the_field_and_the_expectation(document: dict, field: str, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        remote_topology_from_dict(document, "engine.yaml")
    assert error.value.source == "engine.yaml"
    assert error.value.field_path == field
    assert expected in str(error.value)


def test_overrides_and_environment_apply_before_validation(tmp_path, redis_server: RedisServer) -> None:
    path = tmp_path / "remote.yaml"
    path.write_text("tiers:\n  - name: cache\n    type: redis\n    options: {url: redis://127.0.0.1:1}\n")
    loaded = load_remote_topology(path, {"tiers.cache.options.url": redis_server.url}, environ={})
    assert loaded.tiers[0].options.url == redis_server.url
    env = {"TIERCACHE_TIERS__CACHE__OPTIONS__TIMEOUT_S": "0.25"}
    assert load_remote_topology(path, environ=env).tiers[0].options.timeout_s == 0.25
    with pytest.raises(ConfigError, match=r"remote.yaml \(overrides\).*tiers.nope"):
        load_remote_topology(path, {"tiers.nope.options.url": "x"}, environ={})


def test_a_secret_keys_the_values_so_a_store_without_it_cannot_read_them(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TC_TEST_SECRET", "s" * 32)
    keyed = {**topology(redis_server), "model": {"secret_env": "TC_TEST_SECRET"}}
    writer, keyed_reader, plain_reader = store_of(keyed), store_of(keyed), store_of(topology(redis_server))
    try:
        keys = [writer.key(k) for k in engine_keys(COUNT)]
        _, payloads = random_blocks(COUNT, BLOCK_BYTES)
        assert writer.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        assert keyed_reader.read(keys, empty_dests(COUNT, BLOCK_BYTES)).result(WAIT_S) == [True] * COUNT
        assert plain_reader.read(keys, empty_dests(COUNT, BLOCK_BYTES)).result(WAIT_S) == [False] * COUNT
    finally:
        for store in (writer, keyed_reader, plain_reader):
            store.close()
    monkeypatch.setenv("TC_TEST_SECRET", "short")
    with pytest.raises(ConfigError, match=r"model\.secret_env"):
        RemoteStore(remote_topology_from_dict(keyed, "k.yaml"), NAMESPACE, BLOCK_BYTES)


def test_the_shipped_redis_topology_builds_a_store_by_path_and_one_by_mapping_reads_its_writes(
    redis_server: RedisServer,
) -> None:
    """``from_yaml`` and ``from_dict``, as an engine author starts: ``configs/remote/redis.yaml`` aimed at a server."""
    url = {"tiers.redis.options.url": redis_server.url}
    writer = RemoteStore.from_yaml(REPO / "configs" / "remote" / "redis.yaml", NAMESPACE, BLOCK_BYTES, overrides=url,
                                   environ={})
    reader = RemoteStore.from_dict(topology(redis_server), NAMESPACE, BLOCK_BYTES)
    with writer, reader:
        assert writer.names == ["redis"] and writer.topology.source.endswith("redis.yaml")
        _, payloads = random_blocks(COUNT, BLOCK_BYTES, seed=21)
        keys = writer.keys(engine_keys(COUNT, seed=21))
        assert writer.write(keys, payloads).result(WAIT_S) == [True] * COUNT
        views = empty_dests(COUNT, BLOCK_BYTES)
        assert reader.read(keys, views).result(WAIT_S) == [True] * COUNT
        assert [bytes(view) for view in views] == [bytes(payload) for payload in payloads]
