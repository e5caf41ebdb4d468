"""TierCacheTier under vLLM 0.33's real TieringOffloadingSpec and manager, over real redis-servers.

Built through ``OffloadingSpecFactory`` from an ``OffloadingConfig`` whose
``secondary_tiers`` name the tier by module path, as a vLLM user's
``--kv-transfer-config`` does. A store cascades from vLLM's CPU tier into
Redis; a second process (a fresh spec: another engine id, same model) promotes
the chunks byte-identical; another model id or rank misses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.vllm_tiers import engine_over, tier_of
from vllm.v1.kv_offload.base import LookupResult, Medium

from tiercache.integrations.vllm.offloading.metrics import PRESENCE_CHECKS, READ_HITS, WRITES
from tiercache.integrations.vllm.version import UnsupportedVllmError, require_vllm
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_offloading import (
    Engine,
    chunk_keys,
    digest,
    offloading_config,
    payloads,
    redis_topology,
    tier_config,
    wait_replicated,
)

COUNT = 6
CHILD_TIMEOUT_S = 120


def read_in_another_process(topology: dict, prompt: str, count: int, **config: object) -> list[str | None]:
    request = json.dumps({"topology": topology, "prompt": prompt, "count": count, "config": config})
    done = subprocess.run(
        [sys.executable, "-m", "tiercache.testing.vllm_offloading", request],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_store_cascades_into_redis_and_another_process_promotes_it_byte_identical(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    topology = redis_topology(redis_server)
    writer = engine_over(engines, topology)
    keys = chunk_keys(COUNT, "shared-system-prompt")
    data = payloads(COUNT, writer.row_bytes, seed=1)
    writer.store(keys, data)
    writer.settle()  # a store reported finished ...
    assert int(redis_server.cli("DBSIZE")) == COUNT  # ... is in Redis

    # ... and another process (its own engine id, same model and layout) promotes it.
    assert read_in_another_process(topology, "shared-system-prompt", COUNT) == [digest(d) for d in data]

    # In this process too: a fresh spec looks up, promotes into its primary, loads byte-identical chunks.
    reader = engine_over(engines, topology)
    assert reader.read(keys) == data
    reader.settle()
    stats = tier_of(reader).get_stats()
    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{PRESENCE_CHECKS}:('held',)"] == COUNT
    assert reduced[f"{READ_HITS}:('redis',)"] == COUNT
    writer_stats = tier_of(writer).get_stats().reduce()
    assert writer_stats[f"{WRITES}:('stored',)"] == COUNT
    assert reader.all_chunks_free() and writer.all_chunks_free()


def test_a_prompt_longer_than_the_store_bound_is_cascaded_whole(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    """One cascade job of more chunks than queues.max_pending_stores, with nothing else in flight, is taken."""
    topology = redis_topology(redis_server)
    topology["queues"]["max_pending_stores"] = COUNT - 2
    writer = engine_over(engines, topology)
    keys = chunk_keys(COUNT, "long-prompt")
    writer.store(keys, payloads(COUNT, writer.row_bytes, seed=7))
    writer.settle()
    assert int(redis_server.cli("DBSIZE")) == COUNT
    assert tier_of(writer).store.counters().get("writes_dropped", 0) == 0


@pytest.mark.parametrize("config", [{"model": "other-model"}, {"rank": 1}], ids=["model", "rank"])
def test_another_model_or_rank_misses(redis_server: RedisServer, engines: list[Engine], config: dict) -> None:
    topology = redis_topology(redis_server)
    writer = engine_over(engines, topology)
    keys = chunk_keys(COUNT)
    writer.store(keys, payloads(COUNT, writer.row_bytes, seed=2))
    writer.settle()
    other = engine_over(engines, topology, **config)
    assert other.read(keys) == [None] * COUNT
    same = engine_over(engines, topology)
    assert None not in same.read(keys), "the same namespace does hit (the miss above is the namespace's doing)"


def test_lookups_answer_retry_while_the_presence_check_is_in_flight_and_never_wait(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    topology = redis_topology(redis_server)
    writer = engine_over(engines, topology)
    keys = chunk_keys(COUNT)
    writer.store(keys, payloads(COUNT, writer.row_bytes, seed=3))
    writer.settle()
    reader = engine_over(engines, topology)
    tier = tier_of(reader)
    ctx = reader.context()
    with reader.manager.lock:
        reader.manager.on_new_request(ctx)
        assert [tier.lookup(key, ctx) for key in keys] == [LookupResult.RETRY] * COUNT
        assert reader.manager.lookup(keys[0], ctx) is LookupResult.RETRY
    redis_server.stop()  # the presence check sent at the end of this step cannot be answered ...
    try:
        reader.step()
        with reader.manager.lock:  # ... and the next lookups still answer at once
            assert tier.lookup(keys[0], ctx) is LookupResult.RETRY
            assert reader.manager.has_pending_work()
    finally:
        redis_server.cont()
    assert reader.lookup(keys, ctx) == COUNT  # answered once the server is back (or the deadline passed)
    with reader.manager.lock:
        reader.manager.on_request_finished(ctx)
    reader.settle()


def test_events_name_the_tiercache_tier_and_stats_reach_vllm(redis_server: RedisServer, engines: list[Engine]) -> None:
    topology = redis_topology(redis_server)
    writer = engine_over(engines, topology, events=True, tier_options={"enable_kv_events": True, "locality": "REMOTE"})
    keys = chunk_keys(COUNT)
    writer.store(keys, payloads(COUNT, writer.row_bytes, seed=4))
    writer.settle()
    events = [e for e in writer.manager.take_events() if e.ownership is not None]
    assert [(e.medium, e.removed, e.ownership, e.locality.value) for e in events] == [
        (Medium.STORAGE, False, "tiercache:redis", "REMOTE")
    ]
    assert set(events[0].keys) == set(keys)
    definitions = type(writer.spec).build_metric_definitions(dict(writer.spec.extra_config))
    assert {PRESENCE_CHECKS, READ_HITS, WRITES} <= set(definitions)
    info = writer.manager.config_info()
    assert info[1]["tiercache_tiers"] == "redis"


def test_force_latest_reads_the_newest_version_committed_at_central(
    redis_factory, engines: list[Engine]
) -> None:
    central, region_a, region_b = redis_factory(), redis_factory(), redis_factory()

    def regional(region: RedisServer) -> dict:
        options = {"central_url": central.url, "region_url": region.url, "invalidate": False, "timeout_s": 0.5}
        return {"tiers": [{"name": "regional", "type": "regional", "options": options}]}

    keys = chunk_keys(COUNT, "edited-document")
    first = engine_over(engines, regional(region_a))
    old = payloads(COUNT, first.row_bytes, seed=5)
    first.store(keys, old)
    first.settle()
    wait_replicated(first, COUNT)
    second = engine_over(engines, regional(region_b))
    new = payloads(COUNT, second.row_bytes, seed=6)
    second.store(keys, new)  # a newer version of the same chunks, written in the other region
    second.settle()
    wait_replicated(second, COUNT)

    plain = engine_over(engines, regional(region_a))
    assert plain.read(keys) == old, "without force_latest region A serves its own (older) copy"
    latest = engine_over(engines, regional(region_a), tier_options={"force_latest": True})
    assert latest.read(keys) == new, "force_latest: central's newest version, not region A's copy"


def test_bad_tier_options_are_clear_errors_at_startup(redis_server: RedisServer, tmp_path: Path) -> None:
    topology = redis_topology(redis_server)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['topolgy'\]"):
        Engine(offloading_config([{**tier_config(None), "topolgy": topology}])).shutdown()
    with pytest.raises(ValueError, match="'topology' is required"):
        Engine(offloading_config([tier_config(None)])).shutdown()
    with pytest.raises(ValueError, match="force_latest needs a versioned tier"):
        Engine(offloading_config([tier_config(topology, force_latest=True)])).shutdown()
    bad = tmp_path / "remote.yaml"
    bad.write_text("tiers:\n  - type: redis\n    options: {url: 7}\n")
    with pytest.raises(ValueError, match=r"remote.yaml: tiers\[0\].options.url"):
        Engine(offloading_config([tier_config(str(bad))])).shutdown()


def test_another_vllm_release_is_refused_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.34.1" if name == "vllm" else real(name))
    with pytest.raises(UnsupportedVllmError, match=r"written for vLLM 0\.33\.0 .* has vLLM 0\.34\.1"):
        require_vllm()
