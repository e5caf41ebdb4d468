"""Closing a regional tier is bounded whatever central does (issue 11 item 1): under publish traffic, alone and
under a manager, and ``stop_tasks`` with a task that ignores cancels. Real redis-servers (central and two regions).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import numpy as np
import pytest
import redis.asyncio as aioredis
from support.manager_helpers import TINY_LAYOUT, topology
from support.sync_sites import BLOCK_BYTES, FINGERPRINT, Topology, eventually, holds, key, payload

from tiercache.blocks.codec import Codec
from tiercache.manager.tier_manager import TierManager
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier
from tiercache.tiers.shutdown import stop_tasks

CLOSES = 50
CLOSE_BOUND_S = 60.0
"""Failure detector only: a close that has not returned by then is taken as hung (it normally takes ms)."""


async def _publish_until(stop: asyncio.Event, url: str, channel: str) -> None:
    """Publish update messages (key + version) as fast as the server takes them, until ``stop`` is set.

    A stop flag, not a cancel: redis-py can swallow a cancel (the very bug under test).
    """
    client = aioredis.Redis.from_url(url)
    try:
        for i in itertools.count():
            if stop.is_set():
                return
            await client.publish(channel, key(i % 64) + (i + 1).to_bytes(8, "little"))
    finally:
        await client.aclose()


async def test_close_is_bounded_under_publish_traffic(sites: Topology) -> None:
    """Issue 11 item 1: a cancel swallowed inside redis-py once left close() waiting forever on the invalidator."""
    stop = asyncio.Event()
    publisher = asyncio.create_task(_publish_until(stop, sites.central.url, "tiercache:updates"))
    try:
        for i in range(CLOSES):
            before = asyncio.all_tasks()
            tier = RegionalTier(
                RemoteContext("regional", Codec(FINGERPRINT), BLOCK_BYTES),
                RegionalOptions(central_url=sites.central.url, region_url=sites.region_a.url),
            )
            await tier.start()
            assert tier.invalidator is not None
            await eventually(lambda tier=tier: holds(tier.invalidator.received > 0))
            assert await tier.put([key(1000 + i)], [payload(i)]) == [True]
            tasks = asyncio.all_tasks() - before  # the tier's own: replication workers, invalidator
            closing = asyncio.create_task(tier.close())
            done, _ = await asyncio.wait({closing}, timeout=CLOSE_BOUND_S)
            assert closing in done, f"close {i} did not return"
            assert all(task.done() for task in tasks), f"close {i} left background tasks running"
            assert tier.stats()["close_abandoned"] == 0
    finally:
        stop.set()
        await publisher


async def test_a_task_that_ignores_cancels_is_abandoned_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """``stop_tasks`` never waits without a bound, even on a task that swallows every cancel."""
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn(), name="stubborn")
    with caplog.at_level("WARNING"):
        abandoned = await asyncio.wait_for(stop_tasks([task], grace_s=0.0, cancel_s=0.2, what="test"), CLOSE_BOUND_S)
    assert abandoned == 1 and not task.done()
    assert any("abandoned: stubborn" in r.getMessage() for r in caplog.records)
    release.set()
    task.cancel()
    await task


MANAGER_CLOSES = 20


async def test_manager_close_with_a_regional_tier_is_bounded_under_publish_traffic(sites: Topology) -> None:
    """Issue 11 item 1 as an engine meets it: the manager's close waited forever on the regional tier."""
    stop = asyncio.Event()
    publisher = asyncio.create_task(_publish_until(stop, sites.central.url, "tiercache:updates"))
    options = {"central_url": sites.central.url, "region_url": sites.region_a.url}
    remote = {"type": "regional", "name": "regional", "options": options}
    block = TINY_LAYOUT["block_size"]
    try:
        for i in range(MANAGER_CLOSES):
            manager = TierManager(topology(4, 16, remotes=[remote]))
            await manager.start()
            tier = manager.parts.remotes[0]
            assert isinstance(tier, RegionalTier) and tier.invalidator is not None
            await eventually(lambda tier=tier: holds(tier.invalidator.received > 0))
            tokens = np.arange(block) + i * block
            ids = manager.allocate(1)
            await manager.store(tokens, ids)
            manager.release(ids)
            loop = tier.replicator.workers[0].get_loop()  # the manager's background loop, where the tier runs
            tasks = asyncio.all_tasks(loop)
            closing = asyncio.create_task(manager.close())
            done, _ = await asyncio.wait({closing}, timeout=CLOSE_BOUND_S)
            assert closing in done, f"manager close {i} did not return"
            assert all(task.done() for task in tasks), f"manager close {i} left regional tasks running"
    finally:
        stop.set()
        await publisher
