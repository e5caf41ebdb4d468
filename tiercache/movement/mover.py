"""The mover: runs the hierarchy's moves on the queues and reports each outcome back to it.

The one completion path. After every critical section the manager calls
``dispatch`` (still under its lock): a ``HostCopy`` goes to the swap queue, a
``RemotePut`` to its transfer lane. A copy's completion (on the copy thread or
the loop) and a put's (on the loop) take the lock once, tell the hierarchy, wake
loads waiting for those CPU writes, and dispatch whatever the hierarchy asks for
next: no hop back and forth between threads. A remote's report of blocks it
dropped by itself (``evicted``, from any thread) arrives here too; a block
dropped while its put was still in flight is forgotten once the put has landed.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.moves import HostCopy, RemotePut
from tiercache.movement.lanes import Lane
from tiercache.movement.loads import FillWaiters
from tiercache.movement.runtime import Runtime
from tiercache.movement.swap.queue import SwapQueue
from tiercache.telemetry.counters import Metrics


class Mover:
    """Hands moves to the swap queue and the transfer lanes; feeds completions back."""

    def __init__(
        self,
        lock: threading.RLock,
        hierarchy: Hierarchy,
        swap: SwapQueue | None,
        lanes: list[Lane],
        runtime: Runtime,
        waiters: FillWaiters,
        views: Callable[[int], memoryview],
        metrics: Metrics,
        bytes_per_block: int,
    ) -> None:
        self.lock = lock
        self.hierarchy = hierarchy
        self.swap = swap
        self.lanes = lanes
        self.runtime = runtime
        self.waiters = waiters
        self.views = views
        self.metrics = metrics
        self.bytes_per_block = bytes_per_block
        self._putting: list[dict[bytes, bool]] = [{} for _ in lanes]
        """Per lane, the keys with a put in flight, and whether the remote reported dropping them meanwhile."""

    def dispatch(self) -> list[concurrent.futures.Future[bool]]:
        """Start every move in the hierarchy's outbox (call under the lock); returns the copies started."""
        copies = []
        outbox = self.hierarchy.outbox
        while outbox:
            move = outbox.pop(0)
            if isinstance(move, HostCopy):
                assert self.swap is not None
                copy = self.swap.to_host(move.gpu_ids, move.cpu_slots, before_reuse=move.before_reuse)
                copy.add_done_callback(lambda done, move=move: self._copy_done(move, done.result()))
                copies.append(copy)
            else:
                putting = self._putting[move.lane]
                for key in move.keys:
                    putting[key] = False
                self.runtime.submit(self._put(move))
        return copies

    def _copy_done(self, move: HostCopy, ok: bool) -> None:
        with self.lock:
            self.hierarchy.copy_done(move, ok)
            self.waiters.ended(move.keys, [ok] * len(move.keys))
            self.dispatch()

    async def _put(self, move: RemotePut) -> None:
        lane = self.lanes[move.lane]
        oks = await lane.put(move.keys, [self.views(slot) for slot in move.cpu_slots])
        with self.lock:
            putting = self._putting[move.lane]
            dropped = [key for key in move.keys if putting.pop(key, False)]
            self.hierarchy.put_done(move, oks)
            if dropped:
                self.hierarchy.forget(move.lane, dropped)
            self.metrics.add(lane.name, "bytes_written", sum(oks) * self.bytes_per_block)
            self.dispatch()

    def evicted(self, lane: int, keys: Sequence[bytes]) -> None:
        """The remote at ``lane`` dropped ``keys`` by itself (its eviction report, from any thread)."""
        with self.lock:
            putting = self._putting[lane]
            settled = []
            for key in keys:
                if key in putting:
                    putting[key] = True
                else:
                    settled.append(key)
            self.hierarchy.forget(lane, settled)
