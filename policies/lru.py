"""Least-recently-used: evict the key whose last access is oldest; and the pieces of the policies built from
LRU/FIFO lists (ARC, 2Q, S3-FIFO)."""

from __future__ import annotations

from collections import OrderedDict

from tiercache.policies.base import CanEvict, EvictionPolicy, Key

NO_KEY: object = object()
"""Marks 'no key' where any hashable, even None, may be a key (a pending ghost hit, an absent entry)."""


class LRUPolicy(OrderedDict[Key, None], EvictionPolicy):
    """The resident keys themselves, as an OrderedDict in recency order (oldest first).

    Being the OrderedDict, rather than holding one, makes ``len(policy)``,
    ``key in policy`` and ``insert`` (OrderedDict.setdefault) C calls with no
    Python frame: a miss in the access-evict-insert loop runs two Python methods
    instead of five. Equality, hashing and repr stay those of an object.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        OrderedDict.__init__(self)
        EvictionPolicy.__init__(self, capacity)

    def access(self, key: Key) -> bool:
        if key in self:
            self.move_to_end(key)
            return True
        return False

    # insert(key) -> None: setdefault adds an absent key at the MRU end, valued None.
    insert = OrderedDict.setdefault

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        if can_evict is None:
            return self.popitem(last=False)[0]
        key = oldest_evictable(self, can_evict)
        if key is None:
            raise LookupError("lru: every resident key is pinned")
        del self[key]
        return key

    def remove(self, key: Key) -> None:
        self.pop(key, None)

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, resident={len(self)})"


def oldest_evictable(order: OrderedDict[Key, None], can_evict: CanEvict | None) -> Key | None:
    """The oldest key of ``order`` that ``can_evict`` allows (None if none); ``order`` is unchanged.

    Pinned keys are stepped over in place, so their position is kept; one pass at most.
    Shared by the policies built from LRU/FIFO lists (ARC, 2Q).
    """
    if can_evict is None:
        return next(iter(order), None)
    for key in order:
        if can_evict(key):
            return key
    return None


class TwoListPolicy(EvictionPolicy):
    """A policy whose resident keys are split between two ordered lists (ARC's T1 and T2, 2Q's A1in and Am).

    The subclass sets ``_resident`` to its two lists; its ghost lists are its own and are never resident.
    """

    _resident: tuple[OrderedDict[Key, None], OrderedDict[Key, None]]

    def remove(self, key: Key) -> None:
        first, second = self._resident
        if first.pop(key, NO_KEY) is NO_KEY:
            second.pop(key, None)

    def __len__(self) -> int:
        first, second = self._resident
        return len(first) + len(second)

    def __contains__(self, key: object) -> bool:
        first, second = self._resident
        return key in first or key in second


def remember(ghosts: OrderedDict[Key, None], key: Key, capacity: int) -> None:
    """Append ``key`` to a ghost FIFO of ``capacity`` keys, dropping the oldest if full.

    Shared by S3-FIFO's ghost queue and 2Q's A1out; a capacity of 0 keeps nothing.
    """
    if not capacity:
        return
    if len(ghosts) >= capacity:
        ghosts.popitem(last=False)
    ghosts[key] = None
