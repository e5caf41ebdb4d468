"""tiercache's policies as vLLM CachePolicy classes, driven through vLLM's own CPU offloading manager.

Each request of a trace is what vLLM's scheduler does for one chunk: look it
up; on a hit prepare and complete its load, on a miss prepare and complete its
store (the manager evicts through the policy); finish the request. The hits
must be libCacheSim's, request for request (libCacheSim's Python bindings are
the independent reference), and the policies load by module path the way a
vLLM user's config names them.
"""

from __future__ import annotations

from collections.abc import Callable

import libcachesim as lcs
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

import tiercache.integrations.vllm as adapter
from tiercache.testing.policy_traces import TRACES
from tiercache.testing.vllm_offloading import Engine, chunk_keys, offloading_config, payloads

TRACE_REQUESTS = 12_000
SIZE_FRACTIONS = (0.05, 0.2)
"""Cache sizes as fractions of a trace's distinct keys (at least ``MIN_SIZE``)."""
MIN_SIZE = 20
HASHPOWER = 16

REFERENCES: dict[str, Callable[[int], lcs.CacheBase]] = {
    "TierCacheLRU": lambda size: lcs.LRU(size, hashpower=HASHPOWER),
    "TierCacheARC": lambda size: lcs.ARC(size, hashpower=HASHPOWER),
    "TierCacheS3FIFO": lambda size: lcs.S3FIFO(
        size, hashpower=HASHPOWER, small_size_ratio=0.1, ghost_size_ratio=0.9, move_to_main_threshold=2
    ),
    "TierCache2Q": lambda size: lcs.TwoQ(size, hashpower=HASHPOWER, a_in_size_ratio=0.25, a_out_size_ratio=0.5),
}
"""libCacheSim's implementation of each policy, with tiercache's default options."""


def replay_through_vllm(policy: str, size: int, trace: list[int]) -> list[bool]:
    """Hit or miss of each request, as vLLM's CPUOffloadingManager with the policy serves them."""
    manager = CPUOffloadingManager(num_chunks=size, cache_policy=policy, cache_policy_module_path=adapter.__name__)
    hits = []
    for index, item in enumerate(trace):
        key = make_offload_key(item.to_bytes(8, "big"), 0)
        ctx = ReqContext(req_id=f"r{index}")
        manager.on_new_request(ctx)
        hit = manager.lookup(key, ctx) is LookupResult.HIT
        if hit:
            manager.prepare_load([key], ctx)
            manager.complete_load([key], ctx)
        else:
            out = manager.prepare_store([key], ctx)
            assert out is not None and out.keys_to_store == [key]
            manager.complete_store([key], ctx)
        manager.on_request_finished(ctx)
        hits.append(hit)
    return hits


@pytest.mark.parametrize("fraction", SIZE_FRACTIONS)
@pytest.mark.parametrize("trace_name", sorted(TRACES))
@pytest.mark.parametrize("policy", sorted(REFERENCES))
def test_through_vllms_cpu_manager_each_request_is_libcachesims(policy: str, trace_name: str, fraction: float) -> None:
    trace = TRACES[trace_name](TRACE_REQUESTS)
    size = max(MIN_SIZE, int(len(set(trace)) * fraction))
    ours = replay_through_vllm(policy, size, trace)
    reference = REFERENCES[policy](size)
    theirs = [reference.get(lcs.Request(obj_size=1, obj_id=key, clock_time=i)) for i, key in enumerate(trace)]
    assert 0 < sum(theirs) < len(trace), "a degenerate trace could not tell policies apart"
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    assert first is None, f"{policy} c={size} {trace_name}: request {first} (key {trace[first]}) differs"


def test_s3fifo_is_one_config_line_and_resists_a_scan_that_flushes_vllms_lru() -> None:
    """A hot set, a long one-time scan, the hot set again: S3-FIFO keeps it where LRU loses it."""
    hot = list(range(1, 41)) * 4
    trace = hot + list(range(1000, 1400)) + hot
    hits = {name: sum(replay_through_vllm(name, 100, trace)[-len(hot) :]) for name in ("TierCacheS3FIFO", "lru")}
    assert hits["TierCacheS3FIFO"] > hits["lru"]


def test_the_tiering_spec_builds_its_cpu_tier_with_the_policy_named_in_the_config(engines: list[Engine]) -> None:
    config = offloading_config(
        extra={"eviction_policy": "TierCacheS3FIFO", "cache_policy_module_path": "tiercache.integrations.vllm"}
    )
    engine = Engine(config)
    engines.append(engine)
    assert isinstance(engine.primary._policy, adapter.TierCacheS3FIFO)
    keys = chunk_keys(8)
    data = payloads(8, engine.row_bytes, seed=1)
    engine.store(keys, data)
    engine.settle()
    assert engine.read(keys) == data
    assert CachePolicyFactory.get_cache_policy_cls("TierCache2Q", adapter.__name__) is adapter.TierCache2Q


def test_eviction_is_atomic_and_never_takes_a_pinned_or_protected_chunk() -> None:
    manager = CPUOffloadingManager(num_chunks=4, cache_policy="TierCacheARC", cache_policy_module_path=adapter.__name__)
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(6)]
    out = manager.prepare_store(keys[:4], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_load(keys[:3], ctx)  # three chunks pinned by a load in flight
    assert manager.prepare_store(keys[4:6], ctx) is None, "two needed, one evictable: nothing changes"
    assert all(manager.lookup(key, ctx) is LookupResult.HIT for key in keys[:4])
    out = manager.prepare_store(keys[4:5], ctx)
    assert out is not None and out.evicted_keys == [keys[3]]
