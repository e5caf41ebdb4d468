"""The simulated store's link: a bandwidth shared by its clients, served round-robin.

A request is cut into sub-batches of at most ``max_batch_blocks`` blocks, and
the link serves the clients round-robin, one sub-batch per turn. A client
streaming a huge batch therefore delays another client's small request by at
most one sub-batch per other busy client, instead of by its whole batch (which
is what ``fair: false``, first come first served with whole requests, does).
Round-robin per client was chosen over "just split huge batches" because
splitting alone still queues a small request behind every sub-batch already
enqueued.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.tiers.simulated.options import SimulatedOptions

BYTES_PER_MB = 1e6


@dataclass(eq=False)
class _Work:
    """One sub-batch waiting for the link."""

    client: int
    nbytes: int
    done: asyncio.Future[None]


class _Link:
    """The store's link on one event loop: serves queued sub-batches one at a time."""

    def __init__(self, options: SimulatedOptions) -> None:
        self.options = options
        self.fair = options.fair
        self._queues: dict[int, deque[_Work]] = {}
        self._ring: deque[int] = deque()
        self._fifo: deque[_Work] = deque()
        self._wake = asyncio.Event()
        self._server: asyncio.Task[None] | None = None
        self.served: list[int] = []
        """Client ids in the order their sub-batches crossed the link (for fairness checks)."""

    def submit(self, client: int, sizes: Sequence[int]) -> list[asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        if self._server is None or self._server.done():
            self._server = loop.create_task(self._serve())
        works = [_Work(client, size, loop.create_future()) for size in sizes]
        if self.fair:
            queue = self._queues.setdefault(client, deque())
            if not queue and client not in self._ring:
                self._ring.append(client)
            queue.extend(works)
        else:
            self._fifo.extend(works)
        self._wake.set()
        return [work.done for work in works]

    def _next(self) -> _Work | None:
        if not self.fair:
            return self._fifo.popleft() if self._fifo else None
        while self._ring:
            client = self._ring.popleft()
            queue = self._queues[client]
            if not queue:
                continue
            work = queue.popleft()
            if queue:
                self._ring.append(client)
            return work
        return None

    async def _serve(self) -> None:
        while True:
            work = self._next()
            if work is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if work.done.done():
                continue
            rate = self.options.bandwidth_mb_s * BYTES_PER_MB  # read per sub-batch: a test may change it live
            seconds = work.nbytes / rate if rate else 0.0
            await asyncio.sleep(seconds)
            self.served.append(work.client)
            if not work.done.done():
                work.done.set_result(None)

    def close(self) -> None:
        if self._server is not None:
            self._server.cancel()
