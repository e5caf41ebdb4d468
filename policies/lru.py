"""Least-recently-used: evict the entry whose last request is oldest; and the piece the policies built from LRU and
FIFO lists share (ARC, 2Q, S3-FIFO): the oldest evictable entry of a list."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from tiercache.policies.base import CanEvict, Entry, EvictionPolicy, Key
from tiercache.policies.ghosts import Ghosts
from tiercache.policies.lists import NOT_LISTED, EntryLists

RESIDENT = 0
"""The one list of an LRU policy."""


class LRUPolicy(EvictionPolicy):
    """The resident entries in one linked list in recency order (oldest first)."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order = EntryLists(capacity, 1)

    def hit(self, entry: Entry) -> None:
        self._order.move_to_end(entry, RESIDENT)

    def miss(self, key: Key) -> None:
        """LRU keeps no ghosts: nothing to learn from a miss."""

    def insert(self, entry: Entry, key: Key) -> None:
        self._order.append(RESIDENT, entry)

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Entry:
        entry = oldest_evictable(self._order, RESIDENT, can_evict)
        if entry < 0:
            raise LookupError("lru: every resident entry is pinned")
        self._order.unlink(entry)
        return entry

    def remove(self, entry: Entry) -> None:
        self._order.unlink(entry)

    def swap(self, first: Entry, second: Entry) -> None:
        self._order.exchange(first, second)

    def __len__(self) -> int:
        return self._order.lengths[RESIDENT]

    def __contains__(self, entry: object) -> bool:
        return isinstance(entry, int) and 0 <= entry < self.capacity and self._order.list_of(entry) != NOT_LISTED

    def __iter__(self) -> Iterator[Entry]:
        return self._order.entries(RESIDENT)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, resident={len(self)})"


def oldest_evictable(lists: EntryLists, number: int, can_evict: CanEvict | None) -> Entry:
    """The oldest entry of list ``number`` that ``can_evict`` allows (-1 if none); the list is unchanged.

    Pinned entries are stepped over in place, so their position is kept; one pass at most.
    """
    return lists.oldest_where(number, can_evict)


class TwoListPolicy(EvictionPolicy):
    """A policy whose resident entries are split between two lists (ARC's T1 and T2, 2Q's A1in and Am), each
    entry with its key's fingerprint for the ghost list it may join (``policies/ghosts.py``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._resident = EntryLists(capacity, 2)
        self._fingerprints = array("q", bytes(8 * capacity))

    def _admit(self, number: int, entry: Entry, fingerprint: int) -> None:
        self._resident.append(number, entry)
        self._fingerprints[entry] = fingerprint

    def remove(self, entry: Entry) -> None:
        self._resident.unlink(entry)

    def swap(self, first: Entry, second: Entry) -> None:
        self._resident.exchange(first, second)
        fingerprints = self._fingerprints
        fingerprints[first], fingerprints[second] = fingerprints[second], fingerprints[first]

    def __len__(self) -> int:
        lengths = self._resident.lengths
        return lengths[0] + lengths[1]

    def __contains__(self, entry: object) -> bool:
        return isinstance(entry, int) and 0 <= entry < self.capacity and self._resident.list_of(entry) != NOT_LISTED

    def __iter__(self) -> Iterator[Entry]:
        yield from self._resident.entries(0)
        yield from self._resident.entries(1)


def remember(ghosts: Ghosts, fingerprint: int, capacity: int) -> None:
    """Append ``fingerprint`` to ghost list 0, a FIFO of ``capacity``, dropping the oldest if full.

    Shared by S3-FIFO's ghost queue and 2Q's A1out; a capacity of 0 keeps nothing.
    """
    if not capacity:
        return
    if ghosts.lengths[0] >= capacity:
        ghosts.pop_oldest(0)
    ghosts.append(0, fingerprint)
