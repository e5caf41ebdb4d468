"""Priority limiters of the transfer queue, and the ``timeout`` prefetch policy's deadline.

``PriorityLimiter`` bounds the requests in flight to
one tier and always admits a waiting load before a waiting store, and a store
before a waiting exploration: a load is on a request's critical path, a store is
not, and an exploration (the cost model's background fetch) is only an
experiment. Stores and explorations together hold at most
``limit - LOAD_RESERVED_SLOTS`` of the slots, so slow background work in flight
never leaves an arriving load waiting for one of them to finish.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

LOAD_RESERVED_SLOTS = 1
"""Slots of a limiter that only loads may take (when the limit leaves room for stores)."""


class Priority(enum.IntEnum):
    """Lower is served first."""

    LOAD = 0
    STORE = 1
    EXPLORE = 2
    """A background fetch of blocks a request bypassed (``tiercache.movement.explorer``)."""


class PriorityLimiter:
    """A semaphore whose waiters are admitted by priority, then arrival order.

    Stores and explorations hold at most ``store_limit`` slots together (default:
    all but ``LOAD_RESERVED_SLOTS``, at least one), so a load always finds a slot
    free of stores. An exploration is admitted only while ``LOAD_RESERVED_SLOTS``
    stay free after it, even where stores may take every slot (a limit of one):
    it never takes the slot a load arriving next needs.
    """

    def __init__(self, limit: int, store_limit: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.store_limit = max(1, limit - LOAD_RESERVED_SLOTS) if store_limit is None else store_limit
        if not 1 <= self.store_limit <= limit:
            raise ValueError(f"store_limit must be in [1, {limit}], got {store_limit}")
        self.active = 0
        self.active_stores = 0
        self.active_explorations = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(not future.done() for _, _, future in self._waiters)

    def _admits(self, priority: int) -> bool:
        if self.active >= self.limit:
            return False
        background = self.active_stores + self.active_explorations
        if priority == Priority.STORE:
            return background < self.store_limit
        if priority == Priority.EXPLORE:
            return background < self.store_limit and self.active + LOAD_RESERVED_SLOTS < self.limit
        return True

    def _count(self, priority: int, step: int) -> None:
        """Slots held: ``step`` more (or fewer) of ``priority``."""
        self.active += step
        if priority == Priority.STORE:
            self.active_stores += step
        elif priority == Priority.EXPLORE:
            self.active_explorations += step

    async def acquire(self, priority: Priority) -> None:
        if self._admits(priority) and not self._waiters:
            self._count(priority, 1)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (int(priority), next(self._order), future))
        self._dispatch()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(priority)
            raise

    def release(self, priority: Priority = Priority.LOAD) -> None:
        """Give back a slot taken with ``priority`` and admit waiters in order."""
        self._count(priority, -1)
        self._dispatch()

    def _dispatch(self) -> None:
        """Admit waiters from the head of the queue while their priority has room."""
        while self._waiters:
            waiter_priority, _, future = self._waiters[0]
            if future.done():
                heapq.heappop(self._waiters)
                continue
            if not self._admits(waiter_priority):
                break
            heapq.heappop(self._waiters)
            self._count(waiter_priority, 1)
            future.set_result(None)

    async def run(self, priority: Priority, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation()`` inside the limit."""
        await self.acquire(priority)
        try:
            return await operation()
        finally:
            self.release(priority)


