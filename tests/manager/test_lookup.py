"""The lookup has one owner, and looking up has no side effect but its pins.

A scheduler retries lookups while a remote answers, drops some unloaded and
loads others: the counters, the cost model's schedule and what the bookkeeping
forgets must come out the same as if it had looked up once per request and
loaded. "Could not tell" (a timeout) is neither a hit nor a removal.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from support.manager_helpers import TINY_LAYOUT, block_kv, read_block, topology

from tiercache.manager.tier_manager import Lookup, TierManager

BLOCK = TINY_LAYOUT["block_size"]
BLOCKS = 4
WAIT_S = 10.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""
SLOW_FETCH_S = 10.0
"""What the cost model is told one fetch of the prompt took: far slower than recomputing its 8 tokens."""
SLOW_READ_MS = 500.0
"""What the remote's reads (the explorations') really take: slower than recomputing the 8 tokens (80 ms)."""


def engine(**remote_options: Any) -> TierManager:
    remote = {"type": "simulated", "name": "sim", "options": {"latency_ms": 0, **remote_options}}
    cost = {"enabled": True, "prefill_tokens_per_s": 100.0, "explore_fraction": 0.25}
    return TierManager(topology(8, 8, remotes=[remote], cost=cost, queues={"remote_lookup_timeout_ms": 1000}))


def seed(manager: TierManager, tokens: np.ndarray) -> list[bytes]:
    """The prompt's blocks are in the remote only."""
    tier = manager.parts.remotes[0]
    keys = manager.hasher.keys(tokens)
    for key in keys:
        payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
        tier.store.save(key, tier.codec.encode_value(key, payload))
    return keys


def settled(manager: TierManager, tokens: np.ndarray) -> Lookup:
    hit = manager.lookup(tokens)
    deadline = time.monotonic() + WAIT_S
    while hit.pending:
        assert time.monotonic() < deadline, "the remote lookup never answered"
        time.sleep(0.001)
        hit = manager.lookup(tokens)
    return hit


def counters(manager: TierManager) -> dict[str, Any]:
    """The numbers a retried lookup must not move: cost decisions, hits, what was forgotten."""
    tiers = manager.stats()["tiers"]
    cost = {name: tiers.get("sim", {}).get(name) for name in ("fetches_planned", "bypassed_slower_than_recompute",
                                                              "explored")}
    hits = {name: tiers.get("all", {}).get(name, 0) for name in ("hit_blocks", "lookup_blocks", "loaded_blocks")}
    return {**cost, **hits}


def one_request(manager: TierManager, tokens: np.ndarray, keys: list[bytes], lookups: int) -> str:
    """Look up ``lookups`` times (the last one is used), load, check the KV, then drop the local copies."""
    answers = {settled(manager, tokens).tier_blocks["sim"] for _ in range(lookups - 1)}
    hit = settled(manager, tokens)
    answers.add(hit.tier_blocks["sim"])
    assert len(answers) == 1, "lookups of one request disagree"
    fresh = manager.allocate(BLOCKS)
    loaded = manager.load(hit, fresh[: hit.num_lower_blocks]).result(WAIT_S) // BLOCK
    for position, block in enumerate(fresh[:loaded]):
        assert torch.equal(read_block(manager, block), block_kv(manager, keys[position]))
    manager.release(fresh)
    deadline = time.monotonic() + WAIT_S
    while manager.stats()["tiers"]["sim"].get("explorations_in_flight"):  # an exploration lands first
        assert time.monotonic() < deadline, "the exploration never ended"
        time.sleep(0.001)
    for key in keys:  # next request starts from the remote again
        manager.gpu.table.discard(key)
        manager.parts.cpu.table.discard(key)
    return "remote" if hit.tier_blocks["sim"] else "recompute"


def test_retried_lookups_move_no_counter_and_no_cost_schedule() -> None:
    """Two engines serve the same requests; one looks up five times per request: same decisions, same counts."""
    tokens = np.arange(BLOCKS * BLOCK) + 3
    once, retried = engine(), engine()
    with once, retried:
        keys = seed(once, tokens)
        seed(retried, tokens)
        for manager in (once, retried):
            manager.parts.remotes[0].stall("get", SLOW_READ_MS, times=None)  # explorations find it slow too
            with manager._lock:
                manager.parts.cost.observe_fetch("sim", BLOCKS, BLOCKS * manager.layout.bytes_per_block, SLOW_FETCH_S)
        served_once, served_retried = [], []
        for _ in range(10):
            served_once.append(one_request(once, tokens, keys, lookups=1))
            served_retried.append(one_request(retried, tokens, keys, lookups=5))
            assert counters(retried) == counters(once)
        assert served_retried == served_once
        assert served_once == ["recompute"] * 10, "bypassed, and no request's load explores"
        assert counters(once)["explored"] == 10 // 4, "the schedule explores now and then, in the background"
        before = counters(retried)
        for _ in range(7):
            settled(retried, tokens)  # looked up, never loaded nor released
        retried.poll()
        assert counters(retried) == before


def test_a_remote_answer_of_not_held_is_forgotten_once_at_load() -> None:
    with engine() as manager:
        tokens = np.arange(BLOCKS * BLOCK) + 9
        keys = seed(manager, tokens)
        remotes = manager.parts.remote_writes
        with manager._lock:
            remotes.fetched(0, keys, [0] * BLOCKS)  # remembered as written to the remote
        del manager.parts.remotes[0].store.data[keys[2]]  # the remote lost block 2
        for _ in range(3):
            hit = settled(manager, tokens)
            assert hit.tier_blocks["sim"] == 2
            assert all(remotes.written(0, key) for key in keys), "a lookup changed what the bookkeeping knows"
        manager.load(hit, [])
        assert [remotes.written(0, key) for key in keys] == [True, True, False, True]


def test_a_remote_that_cannot_tell_serves_nothing_and_forgets_nothing() -> None:
    remote = {"type": "simulated", "name": "sim", "options": {"latency_ms": 0}}
    config = topology(8, 8, remotes=[remote], queues={"remote_lookup_timeout_ms": 50})
    with TierManager(config) as manager:
        tokens = np.arange(BLOCKS * BLOCK) + 21
        keys = seed(manager, tokens)
        with manager._lock:
            manager.parts.remote_writes.fetched(0, keys, [0] * BLOCKS)
        manager.parts.remotes[0].hold("contains")  # the presence check times out: UNKNOWN
        hit = settled(manager, tokens)
        assert hit.tier_blocks["sim"] == 0 and hit.num_blocks == 0
        manager.load(hit, [])
        assert all(manager.parts.remote_writes.written(0, key) for key in keys)
        manager.parts.remotes[0].unhold("contains")
        deadline = time.monotonic() + WAIT_S
        while (hit := settled(manager, tokens)).tier_blocks["sim"] != BLOCKS:  # the lane's breaker may be open
            manager.release(hit)
            assert time.monotonic() < deadline, "the remote never came back"
            time.sleep(0.01)
        manager.release(hit)


@pytest.mark.parametrize("local_only", [True, False])
def test_a_lookup_pins_what_it_counts_and_nothing_else(local_only: bool) -> None:
    with engine() as manager:
        tokens = np.arange(BLOCKS * BLOCK) + 40
        ids = manager.allocate(BLOCKS)
        manager.store(tokens, ids).result(WAIT_S)
        manager.release(ids[2:])
        state = manager.stats()["tiers"]["gpu"]
        hit = manager.lookup(tokens, local_only=local_only)
        assert hit.gpu_block_ids == ids and hit.tier_blocks["gpu"] == BLOCKS
        assert [manager.gpu.table.ref(block) for block in ids] == [2, 2, 1, 1]
        manager.release(hit)
        manager.release(ids[:2])
        assert manager.stats()["tiers"]["gpu"] == {**state, "evictable_blocks": BLOCKS}
