"""A lane names a caller's mismatched lists at the call, before the tier sees them."""

from __future__ import annotations

import pytest
from support.plugin_tier import DictOptions, DictTier

from tiercache.movement.lanes import Lane
from tiercache.telemetry.counters import Metrics
from tiercache.testing.redis_servers import random_blocks, remote_context
from tiercache.tiers.base import Presence

BLOCK = 64
DEADLINE_S = 5.0


async def test_lists_that_are_not_one_entry_per_key_raise_a_clear_error_and_reach_no_tier() -> None:
    tier = DictTier(remote_context(BLOCK), DictOptions(store="lane-arguments"))
    lane = Lane(0, tier, 2, Metrics(), DEADLINE_S)
    keys, payloads = random_blocks(3, BLOCK)
    with pytest.raises(ValueError, match="3 keys but 2 views"):
        await lane.put(keys, payloads[:2])
    with pytest.raises(ValueError, match="3 keys but 1 checksums"):
        await lane.put(keys, payloads, [None])
    with pytest.raises(ValueError, match="3 keys but 4 views"):
        await lane.read(keys, [memoryview(bytearray(BLOCK)) for _ in range(4)])
    assert await tier.contains(keys) == [Presence.ABSENT] * 3  # nothing was stored
    assert await lane.put(keys, payloads, [None, None, None]) == [True, True, True]
    views = [memoryview(bytearray(BLOCK)) for _ in keys]
    read = await lane.read(keys, views)
    assert read.oks == [True, True, True] and [bytes(v) for v in views] == [bytes(p) for p in payloads]
