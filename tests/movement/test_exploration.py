"""Exploration off the request's path: a remote whose link slows down and recovers, its round trip unchanged.

Only fetches show a link's bandwidth, and a bypassed remote is not fetched from:
the cost model finds a recovery by exploring. Each request's load must ask only
for what the cost model judged worth fetching (never for an experiment), while
explorations fetch the bypassed blocks in the background, at the lanes' lowest
priority, into free or evictable CPU slots, and are dropped (counted) under
back-pressure and cancelled at close.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from support.manager_helpers import block_kv, compute_and_store, read_block, seed_remote, topology, until

from tiercache.manager.tier_manager import Lookup, TierManager

LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32", "block_size": 2}
"""2 KiB blocks: a 4-block prompt is 8 KiB on the link."""
BLOCK = LAYOUT["block_size"]
PROMPT_BLOCKS = 4
RECOMPUTE_TOKENS_PER_S = 40.0
"""A prompt (8 tokens) recomputes in 200 ms."""
SLOW_LINK_MB_S = 0.01
"""A prompt then takes about 0.8 s on the link (four times its recompute); a presence check (64 bytes a key) 26 ms."""
EXPLORE_EVERY = 4
"""``explore_fraction`` 1/4: every fourth would-be bypass explores."""
RECOVERY_BOUND = 2 * EXPLORE_EVERY + 1
"""Requests after the link recovers that may still recompute: an exploration is due every
``EXPLORE_EVERY`` of them, and the fit, gone stale over the requests that bypassed the remote, needs
two to forget a link four times slower than recomputing."""
WAIT_S = 20.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def engine(
    cpu_blocks: int = 16, *, explore_every: int = EXPLORE_EVERY, writes: bool = False, **queues: Any
) -> TierManager:
    """GPU, CPU and a simulated remote written only by ``seed`` (or written through, with ``writes``)."""
    policy = {"write_policy": "write_through"} if writes else {
        "write_policy": "write_through_selective", "admit_after_hits": 1_000_000}
    remote = {"type": "simulated", "name": "sim", **policy, "options": {"latency_ms": 0}}
    cost = {"enabled": True, "prefill_tokens_per_s": RECOMPUTE_TOKENS_PER_S, "explore_fraction": 1 / explore_every}
    config = topology(16, cpu_blocks, layout=LAYOUT, remotes=[remote], cost=cost,
                      queues={"remote_lookup_timeout_ms": 1000, **queues})
    return TierManager(config)


def seed(manager: TierManager, prompts: int) -> list[np.ndarray]:
    """Distinct prompts held by the remote only (so every request starts from it)."""
    return seed_remote(manager, prompts, PROMPT_BLOCKS)


def remote_stats(manager: TierManager) -> dict[str, Any]:
    return manager.stats()["tiers"]["sim"]


def quiet(manager: TierManager) -> None:
    """Wait until no exploration is in flight (an idle scheduler between requests)."""
    until(lambda: not remote_stats(manager).get("explorations_in_flight", 0), WAIT_S)


def request(manager: TierManager, tokens: np.ndarray) -> tuple[int, int]:
    """One request: look up, load what the lookup offers, check it, recompute the rest (nothing stored).

    Returns (remote blocks its load asked for, blocks it was served), once no exploration is in flight.
    """
    hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
    fresh = manager.allocate(PROMPT_BLOCKS - len(hit.gpu_block_ids))
    served = manager.load(hit, fresh[: hit.num_lower_blocks]).result(WAIT_S) // BLOCK
    keys = hit.keys
    for position, block in enumerate(fresh[:served]):
        assert torch.equal(read_block(manager, block), block_kv(manager, keys[position])), "wrong KV served"
    manager.release(hit.gpu_block_ids + fresh)
    quiet(manager)
    return hit.tier_blocks["sim"], served


def test_a_link_that_recovers_is_used_again_without_a_request_waiting_on_an_exploration() -> None:
    """Bandwidth drops then recovers, the round trip stays: explorations run beside the requests, never in them."""
    with engine() as manager:
        prompts = iter(seed(manager, 40))
        link = manager.parts.remotes[0].options
        fast = [request(manager, next(prompts)) for _ in range(3)]
        assert fast == [(PROMPT_BLOCKS, PROMPT_BLOCKS)] * 3, "a fast remote is used"

        link.bandwidth_mb_s = SLOW_LINK_MB_S
        slow = [request(manager, next(prompts)) for _ in range(14)]
        first_bypass = next(i for i, (asked, _) in enumerate(slow) if asked == 0)
        assert first_bypass <= 2, f"the slow link is learnt from the loads that fetched over it: {slow}"
        assert [asked for asked, _ in slow[first_bypass:]] == [0] * (14 - first_bypass), (
            f"no load asks for a bypassed remote, not even to explore it: {slow}"
        )
        before = remote_stats(manager)
        assert before["explored"] >= 2 and before["explored_blocks"] >= 2 * PROMPT_BLOCKS, (
            "the bypassed blocks were fetched in the background"
        )

        link.bandwidth_mb_s = 0.0
        recovered = [request(manager, next(prompts)) for _ in range(RECOVERY_BOUND + 6)]
        resumed = next((i for i, (asked, _) in enumerate(recovered) if asked), len(recovered))
        assert resumed <= RECOVERY_BOUND, f"steady use resumes within {RECOVERY_BOUND} requests: {recovered}"
        assert recovered[resumed:] == [(PROMPT_BLOCKS, PROMPT_BLOCKS)] * (len(recovered) - resumed), recovered
        asked_in_total = sum(asked for asked, _ in fast + slow + recovered)
        assert remote_stats(manager)["hit_blocks"] == asked_in_total, "an exploration is never a hit"


def slow_fit(manager: TierManager) -> None:
    """Teach the cost model that the remote is far slower than recomputing (two observed 10 s fetches: one
    among fast ones would be a stall)."""
    with manager._lock:
        nbytes = PROMPT_BLOCKS * manager.layout.bytes_per_block
        for _ in range(2):
            manager.parts.cost.observe_fetch("sim", PROMPT_BLOCKS, nbytes, 10.0)


def test_an_exploration_never_evicts_pinned_blocks_and_is_dropped_when_the_cpu_tier_is_full() -> None:
    """Every CPU slot pinned by an outstanding lookup: the exploration lands nowhere, counted, nothing evicted."""
    with engine(cpu_blocks=PROMPT_BLOCKS, explore_every=1) as manager:
        cached, explored = seed(manager, 2)
        assert request(manager, cached) == (PROMPT_BLOCKS, PROMPT_BLOCKS)  # staged in the CPU tier
        for key in manager.hasher.keys(cached):  # off the GPU, so a lookup pins the CPU copies
            manager.gpu.table.discard(key)
        pinned: Lookup = manager.lookup_wait(cached, timeout_s=WAIT_S)
        assert pinned.tier_blocks["cpu"] == PROMPT_BLOCKS, "the CPU tier holds the prompt, pinned by a lookup"
        slow_fit(manager)
        assert request(manager, explored) == (0, 0), "bypassed: the request recomputes, and explores"
        stats = remote_stats(manager)
        assert stats["explored"] == 1 and stats["explore_dropped_blocks"] == PROMPT_BLOCKS
        assert stats.get("explored_blocks", 0) == 0
        cpu = manager.parts.cpu.table
        assert all(cpu.readable(key) is not None for key in pinned.keys), "the pinned blocks stay"
        assert not any(key in cpu for key in manager.hasher.keys(explored))
        manager.release(pinned)

        slow_fit(manager)
        manager.load(manager.lookup_wait(explored, timeout_s=WAIT_S), [])  # explores again; the slots are evictable now
        quiet(manager)
        assert remote_stats(manager)["explored_blocks"] == PROMPT_BLOCKS
        assert all(key in cpu for key in manager.hasher.keys(explored)), "an exploration warms the CPU tier"


def test_an_exploration_waits_behind_stores_and_is_dropped_at_its_deadline() -> None:
    """A lane of two slots: a put in flight holds the one slot background work may take; the exploration
    waits behind it, passes its deadline unasked, and is dropped without counting against the remote."""
    with engine(explore_every=1, writes=True, transfer_concurrency=2, remote_lookup_timeout_ms=20) as manager:
        sim = manager.parts.remotes[0]
        (explored,) = seed(manager, 1)
        sim.hold("put")
        compute_and_store(manager, np.arange(PROMPT_BLOCKS * BLOCK))  # written through: a put in the lane
        until(lambda: sim.calls["put"] == 1, WAIT_S)
        slow_fit(manager)
        manager.load(manager.lookup_wait(explored, timeout_s=WAIT_S), [])
        quiet(manager)
        stats = remote_stats(manager)
        assert stats["explored"] == 1 and stats["explorations_starved"] == 1
        assert sim.calls["get"] == 0, "the exploration never reached the remote"
        assert stats.get("lane_breaker_opened", 0) == 0 and stats.get("deadline_misses", 0) == 0
        sim.unhold("put")


def test_close_with_an_exploration_in_flight_cancels_it() -> None:
    with engine(explore_every=1) as manager:
        sim = manager.parts.remotes[0]
        (explored,) = seed(manager, 1)
        slow_fit(manager)
        sim.hold("get")
        manager.load(manager.lookup_wait(explored, timeout_s=WAIT_S), [])
        until(lambda: sim.calls["get"] == 1, WAIT_S)
        closing = threading.Thread(target=manager.close_blocking)
        closing.start()
        closing.join(WAIT_S)
        assert not closing.is_alive(), "close returned"
        stats = remote_stats(manager)
        assert stats["explorations_cancelled"] == 1 and stats.get("explored_blocks", 0) == 0
