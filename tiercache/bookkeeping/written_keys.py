"""What each remote lane is known to hold: the keys seen written there, with when they were last seen.

A key is seen in a remote when a put of it landed or a read of it was served;
each sighting takes the next tick of one clock (``landings``), so an answer of
"not held" given at an earlier tick is known to be stale for a key seen since
(``landed_since``). A key is forgotten when the remote may have lost it (a failed
read, an answer of "not held", its own eviction report), so the next store
writes it again. Bounded per lane: the least recently seen keys past
``remember`` are forgotten first. Pure: no threads, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class WrittenKeys:
    """Per remote lane, the keys known written there and the ``landings`` tick when each was last seen."""

    def __init__(self, lanes: int, remember: int) -> None:
        self.remember = remember
        self.landings = 0
        """Blocks seen in a remote so far (a put landed, a read served): the clock of ``landed_since``."""
        self._seen: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(lanes)]

    def holds(self, lane: int, key: bytes) -> bool:
        """Whether ``key`` is remembered as stored in ``lane``."""
        return key in self._seen[lane]

    def landed(self, lane: int, keys: Iterable[bytes]) -> None:
        """``keys`` were just seen in ``lane`` (a put landed, a read served them)."""
        seen = self._seen[lane]
        for key in keys:
            self.landings += 1
            seen[key] = self.landings
            seen.move_to_end(key)
        while len(seen) > self.remember:
            seen.popitem(last=False)

    def landed_since(self, lane: int, key: bytes, clock: int) -> bool:
        """Whether ``key`` was seen in ``lane`` after ``landings`` read ``clock`` (an older "not held" is stale)."""
        return self._seen[lane].get(key, -1) > clock

    def forget(self, lane: int, keys: Iterable[bytes]) -> None:
        """``lane`` may have lost ``keys``: no longer known written there."""
        seen = self._seen[lane]
        for key in keys:
            seen.pop(key, None)
