"""Explorations: the blocks a request bypassed, fetched in the background so the cost model sees the link.

A remote the cost model bypasses is not fetched from, and only fetches show its
link's bandwidth. Now and then (``Verdict.EXPLORE``) the request that bypassed
it recomputes like any other, and the explorer fetches the blocks the cost cut
took from it, off every request's path:

* at the lane's lowest priority (``Priority.EXPLORE``: behind loads and stores,
  never in the slot a load arriving next needs), dropped unasked at the read
  deadline when the lane stays busy (``explorations_starved``);
* into buffers of its own, so no load waits on the remote for it: what arrived is
  copied into CPU slots taken and committed under the manager's lock but filled
  outside it (a load for a block being copied waits only for that copy);
* one in flight per tier (the cost model's schedule), at most
  ``EXPLORE_MAX_BYTES`` and one load batch of blocks.

It reads through the one read path (``RemoteReader.explore``), which tells the
cost model's owner how long the tier took from the moment it was asked. What
arrived is written into the CPU tier through the bookkeeping's normal path (free
or evictable slots only, never one a lookup pinned; the rest is dropped and
counted), so it warms that tier, and it is never counted as a hit. ``close``
cancels it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from tiercache.movement.base import Bookkeeper, LinkObserver
from tiercache.movement.lanes import Lane
from tiercache.movement.reads import RemoteReader
from tiercache.movement.runtime import Runtime
from tiercache.telemetry.counters import Metrics

EXPLORE_MAX_BYTES = 32 * 2**20
"""Bytes one exploration fetches at most: its buffers are its own, beside the CPU tier's capacity."""


class Explorer:
    """Runs the cost model's explorations on the background loop."""

    def __init__(
        self, books: Bookkeeper, reader: RemoteReader, link: LinkObserver, runtime: Runtime,
        views: Callable[[int], memoryview], metrics: Metrics, *, bytes_per_block: int, batch_blocks: int,
    ) -> None:
        self.books = books
        self.reader = reader
        self.link = link
        self.runtime = runtime
        self.views = views
        self.metrics = metrics
        self.bytes_per_block = bytes_per_block
        self.max_blocks = max(1, min(batch_blocks, EXPLORE_MAX_BYTES // bytes_per_block))
        self._running: set[concurrent.futures.Future[None]] = set()
        self._guard = threading.Lock()
        """Guards ``_running`` and ``_closed`` (``start`` runs on the engine's thread, ``close`` on any)."""
        self._closed = False

    def start(self, lane: int, keys: Sequence[bytes]) -> None:
        """Explore ``keys`` of ``lane`` in the background (once the cost model said EXPLORE)."""
        with self._guard:
            if not self._closed:
                explore = self._explore(self.reader.lanes[lane], list(keys[: self.max_blocks]))
                running = self.runtime.submit(explore, track=False)
                self._running.add(running)
                running.add_done_callback(self._finished)
                return
        self.link.explored(self.reader.lanes[lane].name, 0, 0, None)

    def _finished(self, running: concurrent.futures.Future[None]) -> None:
        with self._guard:
            self._running.discard(running)

    def close(self) -> None:
        """Cancel the explorations in flight (their buffers are their own: nothing else waits on them)."""
        with self._guard:
            self._closed = True
            running = list(self._running)
        for future in running:
            future.cancel()

    async def _explore(self, lane: Lane, keys: list[bytes]) -> None:
        buffers = [bytearray(self.bytes_per_block) for _ in keys]
        try:
            oks = await self.reader.explore(lane, keys, [memoryview(buffer) for buffer in buffers])
        except asyncio.CancelledError:
            self.metrics.add(lane.name, "explorations_cancelled")
            raise
        if oks is not None:
            self._land(lane, keys, buffers, oks)

    def _land(self, lane: Lane, keys: list[bytes], buffers: list[bytearray], oks: list[bool]) -> None:
        """Write what arrived into the CPU tier, head of the chain first: slots begun and committed by the
        bookkeeper, filled here in between (a slot being written is read by no one; a load for its key waits)."""
        writes = self.books.begin_explored(lane.index, keys, oks)
        for position, slot in writes:
            self.views(slot)[:] = buffers[position]
        self.books.end_explored(lane.index, [keys[position] for position, _ in writes], [slot for _, slot in writes])
