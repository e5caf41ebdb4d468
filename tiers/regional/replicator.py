"""Bounded background replication of a region's writes to central, with retries.

A bounded queue (a full queue drops the replication, counted; the regional copy
stays), worker tasks that commit batches at central, retry with exponential
back-off, then patch the assigned version into the regional copy.

Stopping is bounded (``close``): the workers check a stop flag and are cancelled
through ``shutdown.stop_tasks``; what is still queued then is given up, counted
as ``replication_abandoned``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tiercache.common.units import MS_PER_SECOND
from tiercache.tiers.regional.stores import CentralStore, RegionStore
from tiercache.tiers.shutdown import stop_tasks

log = logging.getLogger(__name__)
GIVE_UP_LOG_INTERVAL_S = 10.0
"""At most one "gave up replicating" warning per this many seconds (with the count since the last)."""


@dataclass
class ReplicationItem:
    """One regional write on its way to central."""

    key: bytes
    value: bytes
    checksum: bytes
    enqueued: float


class Replicator:
    """Bounded background replication of a region's writes to central, with retries.

    ``on_done(item, version)`` runs after each item settles (``version`` None when
    it was given up). Nothing raises out of the workers.
    """

    def __init__(
        self,
        central: CentralStore,
        region: RegionStore | None,
        *,
        capacity: int,
        workers: int,
        batch: int,
        retries: int,
        backoff_s: float,
        on_done: Callable[[ReplicationItem, int | None], None],
    ) -> None:
        self.central = central
        self.region = region
        self.queue: asyncio.Queue[ReplicationItem] = asyncio.Queue(capacity)
        self.batch = batch
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_done = on_done
        self.counters = {
            "replicated": 0,
            "replication_retries": 0,
            "replication_failed": 0,
            "replication_dropped": 0,
            "replication_abandoned": 0,
        }
        self.lag_ms_total = 0.0
        self.lag_ms_max = 0.0
        self._stopping = False
        self._warned_at: float | None = None
        self._unwarned = 0
        loop = asyncio.get_running_loop()
        self.workers = [
            loop.create_task(self._work(), name=f"tiercache-replication-{i}") for i in range(workers)
        ]

    def offer(self, item: ReplicationItem) -> bool:
        """Queue ``item``; False (counted) when the queue is full."""
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.counters["replication_dropped"] += 1
            return False
        return True

    async def flush(self) -> None:
        """Wait until everything queued so far has been replicated or given up."""
        await self.queue.join()

    async def close(self, deadline_s: float) -> int:
        """Stop the workers within ``deadline_s`` and give up what is still queued; how many were abandoned."""
        self._stopping = True
        abandoned = await stop_tasks(self.workers, grace_s=0.0, cancel_s=deadline_s, what="replication")
        while not self.queue.empty():
            self.queue.get_nowait()
            self.counters["replication_abandoned"] += 1
            self.queue.task_done()
        return abandoned

    async def _work(self) -> None:
        while not self._stopping:
            items = [await self.queue.get()]
            while len(items) < self.batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            try:
                await self._replicate(items)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replication batch failed; giving it up")
                for item in items:
                    self._settle(item, None)
            finally:
                for _ in items:
                    self.queue.task_done()

    async def _replicate(self, items: list[ReplicationItem]) -> None:
        pending = items
        for attempt in range(self.retries + 1):
            if attempt:
                self.counters["replication_retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            versions = await self.central.commit([(item.key, item.value) for item in pending])
            done = [(item, v) for item, v in zip(pending, versions, strict=True) if v is not None]
            if done and self.region is not None:
                await self.region.stamp([(item.key, item.checksum, v) for item, v in done])
            for item, version in done:
                self._settle(item, version)
            pending = [item for item, v in zip(pending, versions, strict=True) if v is None]
            if not pending:
                return
        for item in pending:
            self._settle(item, None)

    def _settle(self, item: ReplicationItem, version: int | None) -> None:
        if version is None:
            self.counters["replication_failed"] += 1
            self._warn_given_up()
        else:
            self.counters["replicated"] += 1
            lag_ms = (time.monotonic() - item.enqueued) * MS_PER_SECOND
            self.lag_ms_total += lag_ms
            self.lag_ms_max = max(self.lag_ms_max, lag_ms)
        self.on_done(item, version)

    def _warn_given_up(self) -> None:
        """A warning per ``GIVE_UP_LOG_INTERVAL_S`` at most, with the count since the last one."""
        self._unwarned += 1
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < GIVE_UP_LOG_INTERVAL_S:
            return
        diagnosis = self.central.server.diagnosis
        log.warning(
            "regional tier %s: gave up replicating %d value(s) to central %s after %d retries (last cause: %s); "
            "they stay in the region, unversioned",
            diagnosis.tier,
            self._unwarned,
            diagnosis.where,
            self.retries,
            diagnosis.last.name if diagnosis.last is not None else "breaker open",
        )
        self._warned_at = now
        self._unwarned = 0
