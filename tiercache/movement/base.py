"""The interfaces data movement reports through: what the queues learn goes to its owners by these.

``Bookkeeper``: every change the queues make to the bookkeeping (a copy or put
landed, a load's blocks arrived or were handed over, an exploration landed) is
one call, made atomically by the bookkeeping's owner, who holds its lock and
starts the moves it causes; no queue holds the lock. ``LinkObserver``: a lane's
presence checks and reads time the link to a remote tier for the cost model's owner, and
a coded tier asks it what a recompute would cost, so no load, exploration or read holds
the cost model itself.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tiercache.bookkeeping.load_plan import LoadItem
    from tiercache.bookkeeping.moves import HostCopy, RemotePut
    from tiercache.movement.reads import RemoteRead


class LinkObserver(Protocol):
    """Told how long a remote tier took: the cost model's evidence (see ``tiercache.manager.cost``)."""

    def presence_checked(self, tier: str, seconds: float) -> None:
        """A presence check (``contains``) of ``tier`` answered in ``seconds``: its live round trip."""

    def fetched(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        """A load's read of ``blocks`` from ``tier`` took ``seconds`` (the queue wait included: the request felt it)."""

    def explored(self, tier: str, blocks: int, nbytes: int, seconds: float | None) -> None:
        """An exploration of ``tier`` ended: ``seconds`` from the moment the tier was asked, or None when it said
        nothing of the link (never asked, failed early, nothing arrived, cancelled)."""

    def recompute_seconds(self, tokens: int) -> float | None:
        """The engine's expected prefill time for ``tokens`` (None while unknown): what a read weighs a chunk
        against before choosing to leave it to the engine."""


class Bookkeeper(Protocol):
    """The bookkeeping as the queues see it: each call is atomic (under the bookkeeping's one lock), thread-safe,
    and starts the moves it causes. The queues never hold the lock or edit a slot table themselves."""

    # -- the mover's completions
    def copy_done(self, move: HostCopy, ok: bool, checksums: Sequence[int] | None = None) -> None:
        """A GPU->CPU copy landed (or failed); ``checksums``: of each slot's new bytes, when taken."""

    def put_done(self, move: RemotePut, oks: Sequence[bool]) -> None:
        """A put into a remote landed (per key)."""

    def evicted(self, lane: int, keys: Sequence[bytes]) -> None:
        """The remote at ``lane`` dropped ``keys`` by itself (from any thread)."""

    # -- a load's progress
    def wait_for_write(self, key: bytes) -> concurrent.futures.Future[bool]:
        """Resolves when the CPU write of ``key`` in flight ends (True: it landed)."""

    def staged_read_ended(self, items: Sequence[LoadItem], read: RemoteRead) -> None:
        """A remote read of a load's staged items ended (see ``LoadPlanner.arrived``)."""

    def late_read_ended(self, slots: Sequence[int]) -> None:
        """A read past its deadline ended: the slots it held are free again."""

    def fill_landed(self, item: LoadItem) -> bool:
        """The CPU write ``item`` waited for succeeded: pin its slot for the load (False: gone meanwhile)."""

    def handed_over(self, items: Sequence[LoadItem]) -> None:
        """``items`` are in their GPU blocks."""

    def release(self, items: Sequence[LoadItem]) -> None:
        """``items`` were not handed over: drop their pins."""

    def written_clock(self) -> int:
        """The clock of what remotes were told to hold (``RemoteWrites.written_clock``)."""

    def found_absent(self, lane: int, keys: Sequence[bytes], clock: int) -> None:
        """``lane`` answered, at ``clock``, that it does not hold ``keys``."""

    # -- an exploration's landing
    def begin_explored(self, lane: int, keys: Sequence[bytes], oks: Sequence[bool]) -> list[tuple[int, int]]:
        """An exploration of ``lane`` read ``keys`` (``oks``): CPU slots begun for the arrived keys the tier lacks,
        as (position, slot); the rest is dropped and counted."""

    def end_explored(self, lane: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The explored ``keys`` were copied into their ``slots``: commit them."""
