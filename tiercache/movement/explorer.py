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

Its time (from the moment the tier was asked) updates the cost model's fit. What
arrived is written into the CPU tier through the hierarchy's normal path (free or
evictable slots only, never one a lookup pinned; the rest is dropped and counted),
so it warms that tier, and it is never counted as a hit. ``close`` cancels it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.local_tiers import LocalTiers
from tiercache.manager.cost import CostModel
from tiercache.movement.lanes import Lane
from tiercache.movement.loads import FillWaiters
from tiercache.movement.runtime import Runtime
from tiercache.telemetry.counters import Metrics

EXPLORE_MAX_BYTES = 32 * 2**20
"""Bytes one exploration fetches at most: its buffers are its own, beside the CPU tier's capacity."""


class Explorer:
    """Runs the cost model's explorations on the background loop (the manager's lock guards bookkeeping)."""

    def __init__(
        self,
        lock: threading.RLock,
        local: LocalTiers,
        hierarchy: Hierarchy,
        lanes: list[Lane],
        cost: CostModel,
        runtime: Runtime,
        views: Callable[[int], memoryview],
        waiters: FillWaiters,
        metrics: Metrics,
        *,
        bytes_per_block: int,
        batch_blocks: int,
        dispatch: Callable[[], object],
    ) -> None:
        self.lock = lock
        self.local = local
        self.hierarchy = hierarchy
        self.lanes = lanes
        self.cost = cost
        self.runtime = runtime
        self.views = views
        self.waiters = waiters
        """Loads waiting for a CPU slot an exploration is writing."""
        self.metrics = metrics
        self.bytes_per_block = bytes_per_block
        self.max_blocks = max(1, min(batch_blocks, EXPLORE_MAX_BYTES // bytes_per_block))
        self.dispatch = dispatch
        """Starts the moves the hierarchy asked for (the mover's ``dispatch``; called under the lock)."""
        self._running: set[concurrent.futures.Future[None]] = set()
        self._closed = False

    def start(self, lane: int, keys: Sequence[bytes]) -> None:
        """Explore ``keys`` of ``lane`` in the background (call under the lock, once ``count`` said EXPLORE)."""
        if self._closed:
            self.cost.exploration_ended(self.lanes[lane].name)
            return
        running = self.runtime.submit(self._explore(self.lanes[lane], list(keys[: self.max_blocks])), track=False)
        self._running.add(running)
        running.add_done_callback(self._running.discard)

    def close(self) -> None:
        """Cancel the explorations in flight (their buffers are their own: nothing else waits on them)."""
        with self.lock:
            self._closed = True
            running = list(self._running)
        for future in running:
            future.cancel()

    async def _explore(self, lane: Lane, keys: list[bytes]) -> None:
        buffers = [bytearray(self.bytes_per_block) for _ in keys]
        seconds: float | None = None
        timed = len(keys)
        try:
            oks, seconds = await lane.explore(keys, [memoryview(buffer) for buffer in buffers])
            if oks is not None:
                timed = sum(oks)  # what arrived times the link; nothing arrived says nothing of it
                self._land(lane, keys, buffers, oks)
        except asyncio.CancelledError:
            self.metrics.add(lane.name, "explorations_cancelled")
            seconds = None
            raise
        finally:
            with self.lock:
                seconds = seconds if timed else None
                self.cost.exploration_ended(lane.name, timed, timed * self.bytes_per_block, seconds)

    def _land(self, lane: Lane, keys: list[bytes], buffers: list[bytearray], oks: list[bool]) -> None:
        """Write what arrived into the CPU tier, head of the chain first: slots taken under the lock, filled
        outside it (a slot being written is read by no one; a load for its key waits for it), committed under it."""
        hierarchy = self.hierarchy
        with self.lock:
            cpu = self.local.cpu
            assert cpu is not None
            missed = [key for key, ok in zip(keys, oks, strict=True) if not ok]
            hierarchy.forget(lane.index, missed, proven=False)  # rewritten by the next store; routers are not told
            writes: list[tuple[bytes, bytearray, int]] = []
            dropped = 0
            for key, buffer, ok in zip(keys, buffers, oks, strict=True):
                if not ok or key in cpu:
                    continue
                slot = hierarchy.begin_cpu_write(key)
                if slot is None:  # every slot pinned or being written: back-pressure
                    dropped += 1
                    continue
                writes.append((key, buffer, slot))
        for _, buffer, slot in writes:
            self.views(slot)[:] = buffer
        landed, slots = [key for key, _, _ in writes], [slot for _, _, slot in writes]
        with self.lock:
            hierarchy.end_cpu_writes(slots, [True] * len(slots))
            self.waiters.ended(landed, [True] * len(landed))
            if landed:
                hierarchy.fetched(lane.index, landed, slots)
            self.metrics.add(lane.name, "explored_blocks", len(landed))
            self.metrics.add(lane.name, "explore_dropped_blocks", dropped)
            self.metrics.add(lane.name, "explore_misses", len(missed))
            self.dispatch()
