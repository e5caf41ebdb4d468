"""The eviction-policy interface every policy implements (libCacheSim's few operations, over a tier's slots).

A policy orders *entries*: the integers ``0 .. capacity - 1`` that a tier's slots are, so it keeps no map from
keys of its own (the tier's slot table has one; docs/architecture.md, "Eviction policies"). It sees a key only
where a ghost list needs its identity: a miss, and an insert. A tier drives a policy like this, which is also how
libCacheSim simulates a cache of unit-size objects::

    slot = table.get(key)
    if slot is not None:
        policy.hit(slot)
    else:
        policy.miss(key)                      # ghost lists learn here
        while len(policy) >= capacity:
            freed = policy.evict(incoming=key)    # one victim per call: its entry
        policy.insert(free_slot, key)

``KeyedPolicy`` (``policies/keyed.py``) gives any policy that loop over keys alone, for callers without slots.
Pinned or in-flight entries must not be evicted: the tier passes ``can_evict``, and the policy steps over entries
for which it returns False without corrupting its order (at most one pass). The caller guarantees that at least
one resident entry is evictable before calling ``evict``; a tier checks that for the whole batch first, so an
operation that cannot make room fails before anything changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from typing import ClassVar

Key = Hashable
Entry = int
CanEvict = Callable[[Entry], bool]


class EvictionPolicy(ABC):
    """Tracks resident entries (and ghosts of keys, if any) and picks victims."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{type(self).__name__}: capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def hit(self, entry: Entry) -> None:
        """Record a request for a resident entry."""

    @abstractmethod
    def miss(self, key: Key) -> None:
        """Record a request for ``key``, which is not resident (before the evictions and the insert it causes)."""

    @abstractmethod
    def insert(self, entry: Entry, key: Key) -> None:
        """Admit ``key`` as the entry ``entry``, which is not resident; ``miss(key)`` came first, room is made."""

    @abstractmethod
    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Entry:
        """Remove and return one resident entry for which ``can_evict`` holds.

        ``incoming`` is the key whose miss caused the eviction, when there is one (ARC's REPLACE depends on it).
        """

    @abstractmethod
    def remove(self, entry: Entry) -> None:
        """Forget a resident entry (invalidation, not an eviction); no-op if it is not resident."""

    @abstractmethod
    def swap(self, first: Entry, second: Entry) -> None:
        """Exchange two entries' places and keys (the engine bound two admitted keys crosswise); either may be
        non-resident, and the other then becomes so."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident entries."""

    @abstractmethod
    def __contains__(self, entry: object) -> bool:
        """Whether ``entry`` is resident (ghosts do not count)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Entry]:
        """The resident entries, each list oldest first (inspection and tests; O(resident))."""
