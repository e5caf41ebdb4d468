"""A remote that is slow rather than dead: a trickling proxy in front of a real redis-server.

The proxy forwards the server's replies a few bytes at a time, never silent for
long enough to trip a socket timeout. Lookups then miss their deadline; the
transfer lane counts each as a failure, opens, answers misses at once while it
is open, and closes again by itself once the remote answers in time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from support.manager_helpers import TINY_LAYOUT, block_kv, topology, until, write_block
from support.proxies import TrickleProxy

from tiercache.manager.tier_manager import TierManager

BLOCK = TINY_LAYOUT["block_size"]
WAIT_S = 20.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def test_a_trickling_remote_opens_the_lane_and_it_recovers_by_itself(redis_server: Any) -> None:
    with TrickleProxy(redis_server.port) as proxy:
        remote = {
            "name": "redis",
            "type": "redis",
            "write_policy": "write_through",
            "options": {"url": f"redis://127.0.0.1:{proxy.port}", "allow_unbounded": True},
        }
        config = topology(8, 8, remotes=[remote], queues={"remote_lookup_timeout_ms": 40})
        with TierManager(config) as manager:
            wanted, other = np.arange(8 * BLOCK), np.arange(8 * BLOCK) + 10_000
            for tokens in (wanted, other):
                keys = manager.hasher.keys(tokens)
                ids = manager.allocate(8)
                for key, block in zip(keys, ids, strict=True):
                    write_block(manager, block, block_kv(manager, key))
                manager.store(tokens, ids).result(WAIT_S)
                manager.release(ids)
                until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
            proxy.trickle = True
            for _ in range(8):
                manager.release(manager.lookup_wait(wanted, timeout_s=WAIT_S))
            lane = manager.stats()["tiers"]["redis"]
            assert lane["deadline_misses"] >= 3 and lane["lane_breaker_opened"] >= 1
            assert lane["lane_open_skips"] >= 1, "an open lane answers misses without asking the remote"
            proxy.trickle = False

            def recovered() -> bool:
                hit = manager.lookup_wait(wanted, timeout_s=WAIT_S)
                manager.release(hit)
                return hit.tier_blocks["redis"] == 8

            until(recovered)


RECOMPUTE_TOKENS_PER_S = 80.0
"""The engine's prefill rate in the cost-model test: a 4-block prompt (8 tokens) recomputes in 100 ms."""
SLOW_MS, FAST_MS = 300.0, 1.0
"""The simulated remote's round trip while slow (fetching is slower than recomputing) and once fast again:
a hundred times apart, so the machine's load cannot blur them."""
LOOKUP_TIMEOUT_MS = 2000.0
"""Long enough that a slow remote's presence checks are answered (the cost model, not the deadline, decides)."""
PROMPT_BLOCKS = 4


def test_the_cost_model_uses_a_remote_again_within_two_lookups_after_it_is_fast_again() -> None:
    """Through the manager: the lookups' presence checks carry the remote's round trip into the cost model.

    Each request asks for a prompt only the remote holds. While the remote is slow its part is
    recomputed (after one fetch that teaches the model); once it is fast again the second request
    loads from it, with no request made to wait on a slow fetch to find that out.
    """
    remote = {"name": "remote", "type": "simulated", "write_policy": "write_through", "options": {"latency_ms": 0}}
    cost = {"enabled": True, "prefill_tokens_per_s": RECOMPUTE_TOKENS_PER_S}
    queues = {"remote_lookup_timeout_ms": LOOKUP_TIMEOUT_MS}
    config = topology(PROMPT_BLOCKS, PROMPT_BLOCKS, remotes=[remote], cost=cost, queues=queues)
    prompts = [np.arange(PROMPT_BLOCKS * BLOCK) + 1000 * i for i in range(16)]
    with TierManager(config) as manager:
        for tokens in prompts + prompts[:2]:  # every prompt written through to the remote, then out of GPU and CPU
            keys = manager.hasher.keys(tokens)
            ids = manager.allocate(len(keys), tokens)
            for key, block in zip(keys, ids, strict=True):
                write_block(manager, block, block_kv(manager, key))
            manager.store(tokens, ids).result(WAIT_S)
            manager.release(ids)
            until(lambda: manager.stats()["queues"]["pending_stores"] == 0)

        def served_by_remote(tokens: np.ndarray) -> bool:
            hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
            ids = manager.allocate(PROMPT_BLOCKS - len(hit.gpu_block_ids), tokens)
            loaded = manager.load(hit, ids[: hit.num_lower_blocks]).result(WAIT_S)
            manager.release(hit.gpu_block_ids + ids)
            return loaded > 0 and hit.tier_blocks["remote"] == PROMPT_BLOCKS

        manager.parts.remotes[0].options.latency_ms = SLOW_MS
        slow = [served_by_remote(tokens) for tokens in prompts[2:8]]
        assert slow[1:] == [False] * 5, "slower to fetch than to recompute: bypassed"
        manager.parts.remotes[0].options.latency_ms = FAST_MS
        fast = [served_by_remote(tokens) for tokens in prompts[8:]]
        assert fast[2:] == [True] * 6, f"the remote is used again from the second or third lookup on: {fast}"
        stats = manager.stats()["tiers"]["remote"]
        assert stats["explored"] == 0 and stats["round_trip_s"] < SLOW_MS / 1000
