"""The mover: runs the moves in the bookkeeping's outbox on the queues and reports each outcome to the bookkeeper.

The one completion path for the moves the bookkeeping asks for. After every
change the bookkeeper calls ``dispatch`` (under its lock): a ``HostCopy`` goes to
the swap queue, a ``RemotePut`` to its transfer lane. A copy's completion (on the
copy thread or the loop) and a put's (on the loop) are one call each to the
bookkeeper, which tells the bookkeeping, wakes loads waiting for those CPU writes
and dispatches whatever comes next: no hop back and forth between threads.

Checksums are taken once, where the bytes are warm. When remotes that take
checksums lie below, a landed copy's slots are hashed (``value_format.payload_checksum``,
~20 GB/s on bytes already out of the CPU's caches) on the thread that saw the copy
end, before the bookkeeper hears of it; the slot table keeps each slot's checksum,
and every put of the slot (write-through to each remote, a write-back later)
carries it in its move, so a remote's write path sends bytes without reading them first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from tiercache.blocks.value_format import payload_checksum
from tiercache.bookkeeping.moves import HostCopy, Outbox, RemotePut
from tiercache.movement.base import Bookkeeper
from tiercache.movement.lanes import Lane
from tiercache.movement.runtime import Runtime
from tiercache.movement.swap.queue import SwapQueue

log = logging.getLogger(__name__)


class Mover:
    """Hands moves to the swap queue and the transfer lanes; reports completions to the bookkeeper."""

    def __init__(
        self, outbox: Outbox, swap: SwapQueue | None, lanes: list[Lane], runtime: Runtime,
        views: Callable[[int], memoryview],
    ) -> None:
        self.outbox = outbox
        self.swap = swap
        self.lanes = lanes
        self.runtime = runtime
        self.views = views
        self.books: Bookkeeper | None = None
        """Told of every completion; set once by the owner that wires both."""
        self._hash_copies = swap is not None and any(lane.tier.capabilities.takes_checksums for lane in lanes)
        """Whether landed copies' slots are hashed (only when a remote below takes checksums)."""

    def dispatch(self) -> list[concurrent.futures.Future[bool]]:
        """Start every move in the outbox (call under the bookkeeping's lock); returns the copies started."""
        copies, puts = [], []
        while (move := self.outbox.take()) is not None:
            if isinstance(move, HostCopy):
                if self.swap is None:
                    raise RuntimeError("a GPU->CPU copy without a swap queue")
                copy = self.swap.to_host(move.gpu_ids, move.cpu_slots, before_reuse=move.before_reuse)
                copy.add_done_callback(lambda done, move=move: self._copied(move, done.result()))
                copies.append(copy)
            else:
                puts.append(move)
        if puts:  # one hand-off to the loop for them all: each wakes its thread and may take the GIL for a while
            self.runtime.submit(self._put_all(puts))
        return copies

    @property
    def _books(self) -> Bookkeeper:
        if self.books is None:
            raise RuntimeError("the mover has no bookkeeper")
        return self.books

    def _copied(self, move: HostCopy, ok: bool) -> None:
        """A copy ended (on the thread that saw it end): report it, with its slots' checksums when remotes
        take them, hashed here while the copied bytes are still warm."""
        checksums = None
        if ok and self._hash_copies:
            checksums = [payload_checksum(self.views(slot)) for slot in move.cpu_slots]
        self._books.copy_done(move, ok, checksums)

    async def _put_all(self, moves: list[RemotePut]) -> None:
        """Run ``moves`` side by side, each reported on its own; a put that raised is logged."""
        outcomes = await asyncio.gather(*(self._put(move) for move in moves), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                log.error("tiercache background put failed", exc_info=outcome)

    async def _put(self, move: RemotePut) -> None:
        views = [self.views(slot) for slot in move.cpu_slots]
        oks = await self.lanes[move.lane].put(move.keys, views, move.checksums)
        self._books.put_done(move, oks)
