"""Admission: how a tier is filled from the tier above, and the hit counts that selective admission reads.

A tier's write policy (``FillRule``) says when a block enters it:
``write_through`` on store, ``write_back`` on eviction only, and
``write_through_selective`` once the block was hit ``admit_after_hits`` times,
on store and on demotion alike. Hits are counted once per request, when the
engine loads a block (``Hierarchy.count_hits``), never per lookup; the counts
are remembered for a bounded number of keys, the least recently hit forgotten
first. Pure: no threads, no I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class FillRule:
    """How one tier is filled from the tier above it."""

    name: str
    write_policy: WritePolicy
    admit_after_hits: int

    def admits(self, hits: int, *, evicted: bool) -> bool:
        """Whether this tier takes a block hit ``hits`` times now (``evicted``: from an eviction above)."""
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            return hits >= self.admit_after_hits
        return evicted or self.write_policy is WritePolicy.WRITE_THROUGH


class HitCounts:
    """Requests that hit each key, for the last ``remember`` keys hit."""

    def __init__(self, remember: int) -> None:
        self.remember = remember
        self._hits: OrderedDict[bytes, int] = OrderedDict()

    def __getitem__(self, key: bytes) -> int:
        return self._hits.get(key, 0)

    def hit(self, key: bytes) -> int:
        """One more request hit ``key``; returns its count (the oldest keys past ``remember`` are forgotten)."""
        count = self._hits.pop(key, 0) + 1
        self._hits[key] = count
        while len(self._hits) > self.remember:
            self._hits.popitem(last=False)
        return count


class WritePolicy(enum.Enum):
    """How a tier is filled from the tier above it."""

    WRITE_THROUGH = "write_through"
    """Copy down as soon as the block is in the tier above."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Copy down once the block has been hit ``admit_after_hits`` times (admission control)."""
    WRITE_BACK = "write_back"
    """Copy down only when the tier above evicts the block."""
