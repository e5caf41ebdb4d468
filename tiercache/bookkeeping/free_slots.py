"""FreeSlots: a slot table's free list, whose never-used slots cost nothing until taken.

An empty tier of 10^7 slots would otherwise hold 10^7 Python ints (about 400 MB) before it holds a block.
Slots given back are taken first, the newest first; then the never-used ones, lowest first.
"""

from __future__ import annotations

from collections.abc import Iterator


class FreeSlots:
    """The free slots of a table of ``num_slots`` (all free at first)."""

    def __init__(self, num_slots: int) -> None:
        self._returned: list[int] = []
        self._fresh = 0
        """Slots from here up were never taken."""
        self._num_slots = num_slots

    def __len__(self) -> int:
        return len(self._returned) + self._num_slots - self._fresh

    def __bool__(self) -> bool:
        return bool(self._returned) or self._fresh < self._num_slots

    def pop(self) -> int:
        """A free slot (IndexError when none is)."""
        if self._returned:
            return self._returned.pop()
        if self._fresh >= self._num_slots:
            raise IndexError("no free slot")
        self._fresh += 1
        return self._fresh - 1

    def append(self, slot: int) -> None:
        """Give ``slot`` back."""
        self._returned.append(slot)

    def __iter__(self) -> Iterator[int]:
        yield from self._returned
        yield from range(self._fresh, self._num_slots)
