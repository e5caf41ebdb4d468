"""The engine-facing contract as a scheduler drives it: each test pins down one defect the carve fixed.

Lookups are retried, dropped unloaded, followed by an allocate before their
load; prompts share first blocks; remote values go missing or rot. Every reused
block is compared byte for byte with what the toy model computes.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest
import torch
from support.manager_helpers import (
    TINY_LAYOUT,
    WAIT_S,
    block_kv,
    compute_and_store,
    prompt,
    read_block,
    serve,
    settled,
    topology,
    until,
)

from tiercache.manager.tier_manager import TierManager
from tiercache.tiers.simulated import SimulatedTier

BLOCK = TINY_LAYOUT["block_size"]


def sim(**options: Any) -> dict[str, Any]:
    return {"type": "simulated", "name": "sim", "options": {"latency_ms": 0, **options}}


def sim_of(manager: TierManager) -> SimulatedTier:
    tier = manager.parts.remotes[0]
    assert isinstance(tier, SimulatedTier)
    return tier


def seed_remote(manager: TierManager, tokens: np.ndarray, blocks: int) -> None:
    tier = sim_of(manager)
    for key in manager.hasher.keys(tokens)[:blocks]:
        payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
        tier.store.save(key, tier.codec.encode_value(key, payload))


def test_pending_remote_lookups_are_never_shared_between_prompts() -> None:
    """Same first block, same length, different caches: each prompt gets its own answer."""
    with TierManager(topology(16, 32, remotes=[sim()])) as manager:
        short, long = prompt(10, 1, head=1), prompt(10, 2, head=1)
        seed_remote(manager, short, 3)
        seed_remote(manager, long, 10)
        assert manager.hasher.keys(short)[0] == manager.hasher.keys(long)[0]
        sim_of(manager).hold("contains")
        assert manager.lookup(short).pending and manager.lookup(long).pending
        sim_of(manager).unhold("contains")
        long_hit = settled(manager, long)
        assert long_hit.num_blocks == 10, "the long prompt must not get the short one's answer"
        short_hit = settled(manager, short)
        assert short_hit.num_blocks == 3
        manager.release(long_hit.gpu_block_ids)
        manager.release(short_hit.gpu_block_ids)


def test_lookup_counts_every_tier_position_by_position_and_never_reloads_a_resident_block() -> None:
    with TierManager(topology(12, 16)) as manager:
        tokens = prompt(8, 3)
        ids = compute_and_store(manager, tokens)
        for block in ids[4:]:
            manager.gpu.table.pin(block)
        manager.release(manager.allocate(8))
        for block in ids[4:]:
            manager.gpu.table.unpin(block)
        hit = manager.lookup(tokens)
        assert hit.tier_blocks == {"gpu": 4, "cpu": 4} and hit.gpu_block_ids == []
        assert serve(manager, tokens) == 8
        stats = manager.stats()["tiers"]
        assert stats["cpu"]["blocks_out"] == 4, "the 4 GPU-resident blocks must not come from the CPU tier"
        del hit


def test_a_demoted_head_is_still_found_with_write_back() -> None:
    with TierManager(topology(8, 16, cpu={"write_policy": "write_back"})) as manager:
        tokens = prompt(8, 4)
        compute_and_store(manager, tokens)
        manager.release(manager.allocate(4))
        hit = manager.lookup(tokens)
        assert hit.num_blocks == 8, hit.tier_blocks
        assert len(hit.gpu_block_ids) == 4, "the tail is evicted first, so the head stays on the GPU"
        manager.release(hit)


def test_an_allocate_between_lookup_and_load_cannot_evict_the_hit() -> None:
    with TierManager(topology(8, 8, cpu={"write_policy": "write_back"})) as manager:
        wanted, other = prompt(8, 5), prompt(8, 6)
        compute_and_store(manager, wanted)
        compute_and_store(manager, other)
        hit = manager.lookup(wanted)
        assert hit.tier_blocks["cpu"] == 8
        fresh = manager.allocate(8)
        assert manager.load(hit, fresh).result(WAIT_S) == 8 * BLOCK
        for key, block in zip(hit.keys, fresh, strict=True):
            assert torch.equal(read_block(manager, block), block_kv(manager, key))
        manager.release(fresh)


def test_retried_lookups_admit_nothing() -> None:
    config = topology(8, 16, cpu={"write_policy": "write_through_selective", "admit_after_hits": 2})
    with TierManager(config) as manager:
        tokens = prompt(4, 7)
        compute_and_store(manager, tokens)
        for _ in range(3):
            hit = manager.lookup(tokens)
            assert hit.num_blocks == 4
            manager.release(hit.gpu_block_ids)
        stats = manager.stats()["tiers"]
        assert stats["cpu"]["cached_blocks"] == 0, "lookups alone must not count as hits"
        assert stats["gpu"]["evictable_blocks"] == 4, "every lookup pin came back"
        assert serve(manager, tokens) == 4 and serve(manager, tokens) == 4
        until(lambda: manager.stats()["tiers"]["cpu"]["cached_blocks"] == 4)


def test_a_lost_or_corrupted_remote_value_is_written_again() -> None:
    config = topology(4, 4, remotes=[{**sim(), "write_policy": "write_through"}])
    with TierManager(config) as manager:
        tokens = prompt(3, 8)
        keys = manager.hasher.keys(tokens)
        tier = sim_of(manager)
        evictors = iter(range(80, 90))

        def only_remote() -> None:
            """Wait for the puts, then push the prompt out of the GPU and CPU tiers with a new one."""
            until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
            compute_and_store(manager, prompt(4, next(evictors)))
            until(lambda: manager.stats()["queues"]["pending_stores"] == 0)

        compute_and_store(manager, tokens)
        only_remote()
        tier.corrupt(keys[1])
        assert serve(manager, tokens) == 1, "the corrupt block and those after it are recomputed"
        only_remote()
        assert serve(manager, tokens) == 3, "the corrupt value was written again"
        assert tier.stats()["invalid_deleted"] == 1
        tier.store.data.clear()
        only_remote()
        assert serve(manager, tokens) == 0, "a restarted store has nothing"
        only_remote()
        assert serve(manager, tokens) == 3, "and is refilled by the next store"


def test_write_back_victims_stay_inside_the_cpu_capacity_until_their_puts_land() -> None:
    config = topology(4, 4, remotes=[{**sim(), "write_policy": "write_back"}])
    with TierManager(config) as manager:
        first, second = prompt(4, 12), prompt(4, 13)
        tier = sim_of(manager)
        compute_and_store(manager, first)
        tier.hold("put")
        compute_and_store(manager, second)
        stats = manager.stats()
        in_flight = stats["queues"]["pending_stores"]
        assert in_flight == 4, "the evicted blocks are being written back"
        assert stats["tiers"]["cpu"]["cached_blocks"] + in_flight <= 4, "no bytes are held beyond the CPU capacity"
        tier.unhold("put")
        until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
        for key in manager.hasher.keys(first):
            stored = bytearray(manager.layout.bytes_per_block)
            assert tier.codec.decode_into(key, tier.store.data[key], memoryview(stored)).ok
            assert bytes(stored) == block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()


def test_tier_and_manager_counters_keep_their_own_names() -> None:
    config = topology(4, 8, remotes=[{**sim(), "write_policy": "write_through"}])
    with TierManager(config) as manager:
        compute_and_store(manager, prompt(3, 9))
        until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
        manager.release(manager.allocate(4))
        sim_tier = manager.stats()["tiers"]["sim"]
        block_bytes = manager.layout.bytes_per_block
        assert sim_tier["bytes_written"] == 3 * block_bytes, "the manager counts payload bytes"
        assert sim_tier["store"]["bytes_written"] > 3 * block_bytes, "the tier counts what it stored, headers too"
        assert manager.stats()["tiers"]["gpu"]["evictions"] == 3


def test_a_write_through_store_crosses_at_most_three_threads() -> None:
    """CPU device: the engine's thread, the copy thread, the loop; no hops back and forth."""
    config = topology(4, 8, remotes=[{**sim(), "write_policy": "write_through"}])
    with TierManager(config) as manager:
        seen: list[str] = []
        parts = manager.parts
        steps = [(parts.hierarchy, "store"), (parts.hierarchy, "copy_done"), (parts.remote_writes, "write_through"),
                 (parts.remote_writes, "put_done")]
        for part, name in steps:
            method = getattr(part, name)

            def record(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                seen.append(threading.current_thread().name)
                return _method(*args, **kwargs)

            setattr(part, name, record)
        compute_and_store(manager, prompt(2, 10))
        until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
        assert len(set(seen)) <= 3 and seen[0] == threading.current_thread().name
        assert len(seen) == 4, "each step runs once: store, copy landed, put queued (written through), put landed"


@pytest.mark.parametrize("cpu_write", ["write_through", "write_back"])
def test_release_of_a_lookup_drops_every_pin_it_holds(cpu_write: str) -> None:
    with TierManager(topology(8, 16, cpu={"write_policy": cpu_write})) as manager:
        tokens = prompt(6, 11)
        compute_and_store(manager, tokens)
        manager.release(manager.allocate(8))
        until(lambda: manager.stats()["tiers"]["cpu"]["evictable_blocks"] == 6)  # demotions landed (CUDA: async)
        hit = manager.lookup(tokens)
        assert hit.num_blocks == 6 and hit.tier_blocks["cpu"] == 6
        assert manager.stats()["tiers"]["cpu"]["evictable_blocks"] == 0
        manager.release(hit)
        manager.release(hit)
        assert manager.stats()["tiers"]["cpu"]["evictable_blocks"] == 6
        with pytest.raises(ValueError, match="released"):
            manager.load(hit, [])
        dropped = manager.lookup(tokens)
        assert dropped.num_lower_blocks == 6
        del dropped
        gc.collect()
        manager.poll()
        assert manager.stats()["tiers"]["cpu"]["evictable_blocks"] == 6, "a Lookup dropped unused lets go"
        assert manager.stats()["tiers"]["all"]["lookups_abandoned"] == 1


def test_a_block_read_from_a_slower_remote_is_written_into_the_faster_one() -> None:
    fast = {"type": "simulated", "name": "fast", "write_policy": "write_through", "options": {"latency_ms": 0}}
    slow = {"type": "simulated", "name": "slow", "write_policy": "write_back", "options": {"latency_ms": 0}}
    with TierManager(topology(8, 8, remotes=[fast, slow])) as manager:
        tokens = prompt(4, 15)
        slow_tier = manager.parts.remotes[1]
        for key in manager.hasher.keys(tokens):
            payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
            slow_tier.store.save(key, slow_tier.codec.encode_value(key, payload))
        hit = settled(manager, tokens)
        assert hit.tier_blocks == {"gpu": 0, "cpu": 0, "fast": 0, "slow": 4}
        manager.release(hit)
        assert serve(manager, tokens) == 4
        until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
        assert all(key in manager.parts.remotes[0].store.data for key in manager.hasher.keys(tokens))


def test_a_namespace_secret_from_the_environment_rejects_forged_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.secret_env``: a writer with store access but without the secret cannot forge KV."""
    from tiercache.config import ConfigError, config_from_dict

    raw = {
        "model": {"id": "test-model", "secret_env": "TC_TEST_SECRET"},
        "layout": TINY_LAYOUT,
        "tiers": [
            {"type": "gpu", "capacity_blocks": 4, "options": {"device": "cpu"}},
            {"type": "cpu", "capacity_blocks": 8},
            {"type": "simulated", "name": "sim", "options": {"latency_ms": 0, "store": "secret-test"}},
        ],
    }
    monkeypatch.delenv("TC_TEST_SECRET", raising=False)
    with pytest.raises(ConfigError, match="secret_env"):
        TierManager(config_from_dict(raw, environ={}))
    monkeypatch.setenv("TC_TEST_SECRET", "s" * 32)
    tokens = prompt(3, 16)
    with TierManager(config_from_dict(raw, environ={})) as manager:
        tier = sim_of(manager)
        forger = type(tier.codec)(tier.codec.fingerprint)  # same namespace, no secret
        for key in manager.hasher.keys(tokens):
            payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
            tier.store.save(key, forger.encode_value(key, payload))
        assert serve(manager, tokens) == 0, "forged values are misses"
        compute_and_store(manager, prompt(4, 17))
        compute_and_store(manager, prompt(4, 18))
        until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
        assert serve(manager, tokens) == 3, "values written with the secret are served"


def test_a_caller_that_never_polls_holds_a_bounded_number_of_finished_transfers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = 4
    monkeypatch.setattr("tiercache.manager.tier_manager.UNPOLLED_TRANSFERS_KEPT", kept)
    with TierManager(topology(8, 16)) as manager:
        stores = []
        for salt in range(kept + 3):  # one transfer each, waited on through result() and never polled
            tokens = prompt(1, salt)
            ids = manager.allocate(1)
            stores.append(manager.store(tokens, ids))
            assert stores[-1].result(10.0) == BLOCK
            manager.release(ids)
        assert manager.stats()["tiers"]["all"]["unpolled_transfers_dropped"] == 3
        assert manager.poll() == stores[-kept:], "the newest are kept, in the order they finished"
        assert manager.poll() == []
