"""Doubly linked lists of small integers in flat arrays: the order every built-in policy keeps.

A policy's entries are a tier's slots (``policies/base.py``), so its LRU and FIFO lists need no hash map of their
own: each entry's neighbours sit in two 32-bit arrays, 9 bytes an entry with the byte that says which list holds it,
where an OrderedDict of keys costs about 150 bytes a key once it has churned (docs/architecture.md, "Eviction
policies"). Each list has a sentinel after the entries, so linking and unlinking never branch on an empty list.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

NOT_LISTED = 255
"""The list number of an entry no list holds."""

MAX_LISTS = NOT_LISTED
"""Lists one ``EntryLists`` can keep (a list number is a byte)."""


class EntryLists:
    """Disjoint doubly linked lists over the entries ``0 .. size - 1``, oldest first; O(1) append and unlink."""

    def __init__(self, size: int, lists: int) -> None:
        if not 0 < lists <= MAX_LISTS:
            raise ValueError(f"lists must be in [1, {MAX_LISTS}], got {lists}")
        self.size = size
        self._next = array("i", [0]) * (size + lists)
        self._prev = array("i", [0]) * (size + lists)
        self._list = bytearray([NOT_LISTED]) * size
        self.lengths = [0] * lists
        """Each list's length (read it, do not change it: the methods keep it)."""
        for number in range(lists):
            sentinel = size + number
            self._next[sentinel] = self._prev[sentinel] = sentinel

    def grow(self, size: int) -> None:
        """Make room for entries up to ``size - 1``, keeping every list (the sentinels move past them)."""
        old, lists = self.size, len(self.lengths)
        if size <= old:
            return
        added = size - old
        nexts, prevs = self._next[old:], self._prev[old:]
        self._next[old:] = array("i", [0]) * (added + lists)
        self._prev[old:] = array("i", [0]) * (added + lists)
        self._list.extend(bytes([NOT_LISTED]) * added)
        self.size = size
        moved = {old + number: size + number for number in range(lists)}
        for number in range(lists):
            sentinel = size + number
            after, before = nexts[number], prevs[number]
            after, before = moved.get(after, after), moved.get(before, before)
            self._next[sentinel], self._prev[sentinel] = after, before
            self._prev[after] = sentinel
            self._next[before] = sentinel

    def append(self, number: int, entry: int) -> None:
        """Put an unlisted ``entry`` at the newest end of list ``number``."""
        self._insert_after(self._prev[self.size + number], entry, number)

    def _insert_after(self, anchor: int, entry: int, number: int) -> None:
        nexts, prevs = self._next, self._prev
        after = nexts[anchor]
        nexts[anchor] = entry
        prevs[entry] = anchor
        nexts[entry] = after
        prevs[after] = entry
        self._list[entry] = number
        self.lengths[number] += 1

    def exchange(self, first: int, second: int) -> None:
        """Give each of two entries the other's place (either may be unlisted: the other becomes so)."""
        if first == second:
            return
        first_list, second_list = self._list[first], self._list[second]
        for_second = self._prev[first] if first_list != NOT_LISTED else -1  # where ``second`` goes
        for_first = self._prev[second] if second_list != NOT_LISTED else -1
        if for_second == second:  # adjacent: second, first -> first, second
            for_second = first
        if for_first == first:
            for_first = second
        self.unlink(first)
        self.unlink(second)
        if for_second == first:  # ``second`` goes right after ``first``: place ``first`` before it
            placements = ((for_first, first, second_list), (for_second, second, first_list))
        else:
            placements = ((for_second, second, first_list), (for_first, first, second_list))
        for anchor, entry, number in placements:
            if anchor >= 0:
                self._insert_after(anchor, entry, number)

    def unlink(self, entry: int) -> int:
        """Take ``entry`` out of its list; the list's number, or NOT_LISTED (nothing done) if none held it."""
        number = self._list[entry]
        if number == NOT_LISTED:
            return number
        nexts, prevs = self._next, self._prev
        before, after = prevs[entry], nexts[entry]
        nexts[before] = after
        prevs[after] = before
        self._list[entry] = NOT_LISTED
        self.lengths[number] -= 1
        return number

    def move_to_end(self, entry: int, number: int) -> None:
        """Put a listed ``entry`` at the newest end of list ``number`` (its own or another).

        ``unlink`` and ``append`` written out: a policy's hit, the hottest call it has."""
        nexts, prevs, lists = self._next, self._prev, self._list
        before, after = prevs[entry], nexts[entry]
        nexts[before] = after
        prevs[after] = before
        sentinel = self.size + number
        newest = prevs[sentinel]
        nexts[newest] = entry
        prevs[entry] = newest
        nexts[entry] = sentinel
        prevs[sentinel] = entry
        old = lists[entry]
        if old != number:
            lists[entry] = number
            lengths = self.lengths
            lengths[old] -= 1
            lengths[number] += 1

    def oldest(self, number: int) -> int:
        """The oldest entry of list ``number``, or -1 if it is empty."""
        entry = self._next[self.size + number]
        return entry if entry < self.size else -1

    def oldest_where(self, number: int, accept: Callable[[int], bool] | None) -> int:
        """The oldest entry of list ``number`` that ``accept`` allows (any, if None), or -1; the list is unchanged."""
        sentinel, nexts = self.size + number, self._next
        entry = nexts[sentinel]
        if accept is not None:
            while entry != sentinel and not accept(entry):
                entry = nexts[entry]
        return entry if entry != sentinel else -1

    def pop_oldest(self, number: int) -> int:
        """Unlink and return the oldest entry of a non-empty list ``number``."""
        entry = self._next[self.size + number]
        self.unlink(entry)
        return entry

    def list_of(self, entry: int) -> int:
        """The number of the list holding ``entry``, or NOT_LISTED."""
        return self._list[entry]

    def entries(self, number: int) -> Iterator[int]:
        """List ``number``'s entries, oldest first (do not change the list while iterating)."""
        sentinel = self.size + number
        nexts = self._next
        entry = nexts[sentinel]
        while entry != sentinel:
            yield entry
            entry = nexts[entry]
