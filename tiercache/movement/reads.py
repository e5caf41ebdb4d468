"""The one remote read path: blocks read from the remote tiers into the caller's buffers, fastest tier first.

The manager's loads, the cost model's explorations and ``RemoteStore`` (so the
vLLM and SGLang adapters) all read through a ``RemoteReader``:

* each key is asked of the fastest lane first, and of the next lane only where
  the faster ones did not fill it; ``force_latest`` asks only the versioned tiers
  (the regional tier checks central's version), when the topology has any;
* a read past its lane's deadline fails its keys, but may still write into their
  buffers: no slower lane is asked for them, and the answer hands the caller that
  late read (``RemoteRead.late``) to keep those buffers reserved until it is done;
* every lane's read is timed for the link's owner (``LinkObserver``) by one rule:
  what arrived, or a read that ran to its deadline, times the link; a read that
  failed early (an open breaker, an exception, nothing held) says nothing of it.

Where a block came from is in the answer (``RemoteRead.sources``); writing it back
into the faster tiers is the owner's: the manager's hierarchy by its write
policies, ``RemoteStore`` into every faster tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercache.movement.base import LinkObserver
from tiercache.movement.lanes import Lane, LaneRead
from tiercache.movement.limiter import Priority


@dataclass(frozen=True)
class LaneTry:
    """One lane asked during a read: the positions it was asked for and its answer."""

    lane: Lane
    positions: list[int]
    read: LaneRead

    @property
    def missed(self) -> list[int]:
        """Positions it did not fill (every one asked when the call failed as a whole)."""
        oks = self.read.oks
        return list(self.positions) if oks is None else [i for i, ok in zip(self.positions, oks, strict=True) if not ok]


@dataclass
class RemoteRead:
    """What one read brought, lane by lane."""

    sources: list[int | None]
    """Per key, the index of the lane that filled its buffer (None: not filled)."""
    tried: list[LaneTry] = field(default_factory=list)
    """The lanes asked, fastest first."""
    late: asyncio.Future[Any] | None = None
    """A read past its deadline that may still write into the buffers of ``unsettled`` (None: none)."""

    @property
    def unsettled(self) -> list[int]:
        """Positions a late read may still write into: reserve their buffers until ``late`` is done."""
        return self.tried[-1].missed if self.late is not None else []

    @property
    def filled(self) -> list[bool]:
        return [source is not None for source in self.sources]


class RemoteReader:
    """Reads blocks from a topology's lanes (see the module docstring)."""

    def __init__(self, lanes: Sequence[Lane], bytes_per_block: int, link: LinkObserver | None = None) -> None:
        self.lanes = list(lanes)
        self.bytes_per_block = bytes_per_block
        self.link = link
        self.versioned = [lane for lane in self.lanes if lane.tier.capabilities.versioned]

    def lanes_for(self, force_latest: bool) -> list[Lane]:
        """The lanes a read asks: only the versioned ones for ``force_latest`` (when there are any)."""
        return self.versioned if force_latest and self.versioned else self.lanes

    async def read(
        self, keys: Sequence[bytes], views: Sequence[memoryview], *, force_latest: bool = False
    ) -> RemoteRead:
        """Fill ``views[i]`` with the block of ``keys[i]`` from the fastest lane holding it."""
        result = RemoteRead([None] * len(keys))
        pending = list(range(len(keys)))
        late: list[asyncio.Future[Any]] = []
        for lane in self.lanes_for(force_latest):
            if not pending or late:  # a late read may still write into the buffers: no other lane may
                break
            read = await lane.read(
                [keys[i] for i in pending], [views[i] for i in pending], force_latest=force_latest,
                on_late=late.append,
            )
            tried = LaneTry(lane, pending, read)
            result.tried.append(tried)
            arrived = [i for i, ok in zip(pending, read.oks or [], strict=False) if ok]
            for i in arrived:
                result.sources[i] = lane.index
            self._count(lane, len(arrived))
            timed = len(arrived) or (len(pending) if read.timed_out else 0)
            if self.link is not None and timed:
                self.link.fetched(lane.name, timed, timed * self.bytes_per_block, read.waited_s)
            pending = tried.missed
        result.late = late[0] if late else None
        return result

    async def explore(self, lane: Lane, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bool] | None:
        """Read ``keys`` from ``lane`` at the lowest priority, for the cost model (``views`` must be the caller's
        own: a read past its deadline may still write into them). Per key whether it arrived, None when the call
        failed as a whole. The link's owner hears exactly once how long the tier took from the moment it was asked
        (``LinkObserver.explored``; no time when the read said nothing of the link, or was cancelled)."""
        blocks, seconds = len(keys), None
        try:
            read = await lane.read(keys, views, priority=Priority.EXPLORE)
            if read.oks is not None:
                blocks = sum(read.oks)
                self._count(lane, blocks)
            ran_out = read.asked_s is not None and read.asked_s >= lane.read_deadline_s
            if read.oks is not None or ran_out:  # a call that failed before its deadline says nothing of the link
                seconds = read.asked_s
            return read.oks
        finally:
            if self.link is not None:
                self.link.explored(lane.name, blocks, blocks * self.bytes_per_block, seconds if blocks else None)

    def _count(self, lane: Lane, blocks: int) -> None:
        lane.metrics.add(lane.name, "blocks_out", blocks)
        lane.metrics.add(lane.name, "bytes_read", blocks * self.bytes_per_block)
