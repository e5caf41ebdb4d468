"""Issue 15 through the manager: KV events a vLLM subscriber decodes, tiers that step aside, live curves.

The components have their own tests (test_events, test_cost, test_mrc); these
drive them the way an engine does, through a TierManager's API.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from support.manager_helpers import TINY_LAYOUT, block_kv, compute_and_store, read_block, topology, until

from tiercache.manager.tier_manager import TierManager
from tiercache.telemetry.events.wire import block_hash

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
from msgspec.msgpack import Decoder  # noqa: E402
from support.vllm_kv_events import BlockRemoved, BlockStored, KVEventBatch, joined_subscriber, receive  # noqa: E402

BLOCK = TINY_LAYOUT["block_size"]
WAIT_S = 10.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def test_a_vllm_subscriber_decodes_what_the_manager_stores_and_evicts() -> None:
    events = {"enabled": True, "endpoint": "tcp://127.0.0.1:*", "topic": "kv-events"}
    config = topology(4, 8, cpu={"write_policy": "write_back"}, events=events)
    context = zmq.Context()
    try:
        with TierManager(config) as manager:
            sub, _ = joined_subscriber(manager.parts.events, context)
            tokens = np.arange(4 * BLOCK) + 7
            keys = manager.hasher.keys(tokens)
            compute_and_store(manager, tokens)
            manager.release(manager.allocate(4))
            assert manager.parts.events.flush()
            decoder = Decoder(type=KVEventBatch)
            seen: list[Any] = []
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and not any(
                isinstance(e, BlockStored) and e.medium == "cpu" for e in seen
            ):
                seen.extend(decoder.decode(receive(sub)[2]).events)
            stored = [e for e in seen if isinstance(e, BlockStored)]
            gpu = next(e for e in stored if e.medium == "gpu")
            assert gpu.block_hashes == [block_hash(key) for key in keys] and gpu.parent_block_hash is None
            assert gpu.token_ids == [int(t) for t in tokens] and gpu.block_size == BLOCK
            removed = next(e for e in seen if isinstance(e, BlockRemoved))
            assert removed.medium == "gpu" and sorted(removed.block_hashes) == sorted(gpu.block_hashes)
            demoted = next(e for e in stored if e.medium == "cpu")
            assert sorted(demoted.block_hashes) == sorted(gpu.block_hashes)
            sub.close(linger=0)
    finally:
        context.destroy(linger=0)


def test_a_remote_slower_than_recomputing_is_bypassed_until_it_recovers() -> None:
    # The prompt is seeded into the remote; nothing else is ever written there (no puts to wait for).
    remote = {
        "type": "simulated",
        "name": "sim",
        "write_policy": "write_through_selective",
        "admit_after_hits": 1_000_000,
        "options": {"latency_ms": 0},
    }
    cost = {"enabled": True, "prefill_tokens_per_s": 100.0, "explore_fraction": 0.25}
    config = topology(4, 4, remotes=[remote], cost=cost, queues={"remote_lookup_timeout_ms": 1000})
    with TierManager(config) as manager:
        sim = manager.parts.remotes[0]
        tokens = np.arange(4 * BLOCK) + 11
        keys = manager.hasher.keys(tokens)
        for key in keys:
            payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
            sim.store.save(key, sim.codec.encode_value(key, payload))
        evictors = iter(range(100, 10_000))

        def one_request() -> str:
            """Serve the prompt once from wherever lookup says, then push it out of the local tiers."""
            hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
            fresh = manager.allocate(len(hit.keys) - len(hit.gpu_block_ids))
            loaded = manager.load(hit, fresh[: hit.num_lower_blocks]).result(WAIT_S) // BLOCK
            for position, block in enumerate(fresh[:loaded]):
                assert torch.equal(read_block(manager, block), block_kv(manager, keys[position]))
            manager.release(fresh)
            until(lambda: not manager.stats()["tiers"]["sim"].get("explorations_in_flight"))  # landed, then pushed out
            for _ in range(2):
                compute_and_store(manager, np.arange(4 * BLOCK) + next(evictors) * 1000)
            return "remote" if hit.tier_blocks["sim"] else "recompute"

        def counter() -> int:
            return manager.stats()["tiers"]["sim"]["bypassed_slower_than_recompute"]

        assert [one_request() for _ in range(3)] == ["remote"] * 3, "a fast remote is used"
        sim.options.latency_ms = 150.0  # 8 tokens recompute in 80 ms; a fetch now takes 150 ms
        slow = [one_request() for _ in range(40)]
        first = slow.index("recompute")
        assert first <= 2 and "remote" not in slow[first:] and counter() == 40 - first, "the slow remote is bypassed"
        assert manager.stats()["tiers"]["sim"]["explored"] == (40 - first) // 4, "explored in the background"
        sim.options.latency_ms = 0.0
        before = counter()
        recovered = [one_request() for _ in range(40)]
        assert recovered[2:] == ["remote"] * 38, "bypass stops at the second lookup after the remote is fast again"
        assert counter() - before <= 2


def test_stats_carry_a_live_miss_ratio_curve_per_tier() -> None:
    config = topology(8, 16, mrc={"enabled": True, "sample_rate": 1.0})
    with TierManager(config) as manager:
        rng = np.random.default_rng(0)
        for _ in range(200):
            prompt = int(rng.zipf(1.3)) % 40
            compute_and_store(manager, np.arange(2 * BLOCK) + prompt * 1000)
        curve = manager.stats()["tiers"]["gpu"]["mrc"]
        ratios = [curve["hit_ratio"][m] for m in ("0.25", "0.5", "1", "2", "4")]
        assert ratios == sorted(ratios) and 0 < ratios[-1] <= 1
        assert curve["accesses"] == 400


def test_the_curve_reaches_prometheus() -> None:
    from tiercache.telemetry.prometheus import render_prometheus

    with TierManager(topology(8, 16, mrc={"enabled": True, "sample_rate": 1.0})) as manager:
        for prompt in range(20):
            compute_and_store(manager, np.arange(2 * BLOCK) + (prompt % 5) * 1000)
        text = render_prometheus(manager.stats())
    assert 'tiercache_tier_mrc_hit_ratio{capacity_multiple="1",tier="gpu"}' in text


@pytest.mark.parametrize("batch", [np.array, torch.tensor], ids=["numpy", "torch"])
def test_a_batch_of_one_prompt_stores_with_events_and_curves_on(batch: Any) -> None:
    """``[1, T]`` input ids (as tokenizers return them): the events carry the prompt's tokens."""
    config = topology(8, 16, events={"enabled": True}, mrc={"enabled": True, "sample_rate": 1.0})
    with TierManager(config) as manager:
        seen: list[Any] = []
        manager.subscribe(lambda got: seen.extend(got.events))
        tokens = [list(range(40, 40 + 3 * BLOCK))]
        ids = manager.allocate(3)
        assert manager.store(batch(tokens), ids).result(WAIT_S) == 3 * BLOCK
        manager.release(ids)
        assert manager.parts.events.flush()
        (stored,) = [event for event in seen if type(event).__name__ == "BlockStored" and event.medium == "gpu"]
        assert stored.token_ids == tokens[0]
        assert stored.block_hashes == [block_hash(key) for key in manager.hasher.keys(tokens[0])]
        assert manager.stats()["tiers"]["gpu"]["mrc"]["accesses"] == 3


def test_a_demotion_is_told_head_first_with_the_parent_of_its_first_block() -> None:
    events = {"enabled": True, "lineage_blocks": 64}
    config = topology(4, 8, cpu={"write_policy": "write_back"}, events=events)
    with TierManager(config) as manager:
        seen: list[Any] = []
        manager.subscribe(lambda got: seen.extend(got.events))
        tokens = np.arange(4 * BLOCK) + 70
        compute_and_store(manager, tokens)
        manager.release(manager.allocate(4))  # the whole chain is demoted, tail first
        deadline = time.monotonic() + WAIT_S
        while manager.stats()["tiers"]["cpu"]["cached_blocks"] < 4:
            assert time.monotonic() < deadline, "the demotion never landed"
            time.sleep(0.002)
        assert manager.parts.events.flush()
        (demoted,) = [e for e in seen if type(e).__name__ == "BlockStored" and e.medium == "cpu"]
        assert demoted.block_hashes == [block_hash(key) for key in manager.hasher.keys(tokens)]
        assert demoted.parent_block_hash is None and demoted.token_ids == [int(t) for t in tokens]


def test_the_map_wire_names_the_models_lora() -> None:
    from support.vllm_kv_events import NewerBlockStored, NewerKVEventBatch

    events = {"enabled": True, "endpoint": "tcp://127.0.0.1:*", "topic": "kv-events", "wire": "map"}
    config = topology(4, 8, events=events, model={"id": "test-model", "lora": "sql-adapter"})
    context = zmq.Context()
    try:
        with TierManager(config) as manager:
            sub, _ = joined_subscriber(manager.parts.events, context)
            compute_and_store(manager, np.arange(2 * BLOCK) + 90)
            assert manager.parts.events.flush()
            decoded = Decoder(type=NewerKVEventBatch).decode(receive(sub)[2])
            stored = [e for e in decoded.events if isinstance(e, NewerBlockStored)]
            assert stored and all(e.lora_name == "sql-adapter" for e in stored)
            sub.close(linger=0)
    finally:
        context.destroy(linger=0)
