"""A remote that is slow rather than dead: a trickling proxy in front of a real redis-server.

The proxy forwards the server's replies a few bytes at a time, never silent for
long enough to trip a socket timeout. Lookups then miss their deadline; the
transfer lane counts each as a failure, opens, answers misses at once while it
is open, and closes again by itself once the remote answers in time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from manager_helpers import TINY_LAYOUT, block_kv, topology, until, write_block
from proxies import TrickleProxy

from tiercache.manager import TierManager

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
