"""What a lane tells the cost model of a read: only a read that answered, or ran to its deadline, times the link.

A tier that raises at once, or a lane whose breaker is open, says nothing of how
fast the link is; taken as a fetch, it would teach the cost model a fast link
that is in fact down.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from support.manager_helpers import TINY_LAYOUT, topology
from support.plugin_tier import DictOptions, DictTier

from tiercache.manager.tier_manager import TierManager
from tiercache.movement.lanes import Lane
from tiercache.movement.reads import RemoteReader
from tiercache.telemetry.counters import Metrics
from tiercache.testing.redis_servers import random_blocks, remote_context

BLOCK = 64
DEADLINE_S = 0.05
WAIT_S = 10.0
"""Upper bound on waiting for a load (a hang detector, never a speed judgement)."""


class RaisingTier(DictTier):
    """A tier whose reads raise at once (a bug in a plug-in, a client library's error)."""

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        raise OSError("connection reset")


def lane_over(tier: DictTier) -> Lane:
    return Lane(0, tier, 2, Metrics(), DEADLINE_S)  # a lane of one slot keeps it for loads: it never explores


class Explorations:
    """A ``LinkObserver`` that keeps what explorations told it: (tier, blocks, seconds)."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, int, float | None]] = []

    def presence_checked(self, tier: str, seconds: float) -> None:
        pass

    def fetched(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        pass

    def explored(self, tier: str, blocks: int, nbytes: int, seconds: float | None) -> None:
        self.ended.append((tier, blocks, seconds))


async def test_an_exploration_that_raised_gives_no_time_and_one_that_answered_does() -> None:
    keys, payloads = random_blocks(2, BLOCK)
    views = [memoryview(bytearray(BLOCK)) for _ in keys]
    seen = Explorations()
    raising = lane_over(RaisingTier(remote_context(BLOCK), DictOptions(store="raising")))
    assert await RemoteReader([raising], BLOCK, seen).explore(raising, keys, views) is None
    answering_tier = DictTier(remote_context(BLOCK), DictOptions(store="answering"))
    assert await answering_tier.put(keys, payloads) == [True, True]
    answering = lane_over(answering_tier)
    assert await RemoteReader([answering], BLOCK, seen).explore(answering, keys, views) == [True, True]
    (_, _, raised_seconds), (_, answered_blocks, answered_seconds) = seen.ended
    assert raised_seconds is None, "a read that raised timed the link"
    assert answered_blocks == 2 and answered_seconds is not None


def test_loads_from_a_tier_whose_reads_raise_teach_the_cost_model_nothing() -> None:
    remote = {"type": "test_lane_timing:RaisingTier", "name": "raising", "options": {"store": "raising-loads"}}
    cost = {"enabled": True, "prefill_tokens_per_s": 1000.0}
    with TierManager(topology(8, 8, remotes=[remote], cost=cost)) as manager:
        tokens = np.arange(4 * TINY_LAYOUT["block_size"]) + 300
        tier = manager.parts.remotes[0]
        for key in manager.hasher.keys(tokens):
            tier.data[key] = b"held"  # what a presence check sees; the read raises before looking
        for _ in range(3):
            hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
            assert hit.tier_blocks["raising"] == 4
            fresh = manager.allocate(4)
            assert manager.load(hit, fresh).result(WAIT_S) == 0
            manager.release(fresh)
        assert manager.stats()["tiers"]["raising"]["exceptions"] >= 1
        assert manager.stats()["tiers"]["raising"]["observations"] == 0, "a failed read timed the link"
