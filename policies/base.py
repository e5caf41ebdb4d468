"""The eviction-policy interface every policy implements (libCacheSim's few operations).

A tier drives a policy like this, which is also how libCacheSim simulates a cache
of unit-size objects::

    if not policy.access(key):            # miss
        while len(policy) >= capacity:
            policy.evict(incoming=key)    # one victim per call
        policy.insert(key)

Pinned or in-flight entries must not be evicted: the tier passes ``can_evict``,
and the policy steps over keys for which it returns False without corrupting its
order (at most one pass). The caller guarantees that at least one resident key is
evictable before calling ``evict``; a tier checks that for the whole batch first,
so an operation that cannot make room fails before anything changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import ClassVar

Key = Hashable
CanEvict = Callable[[Key], bool]


class EvictionPolicy(ABC):
    """Tracks resident keys (and ghosts, if any) and picks victims."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{type(self).__name__}: capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def access(self, key: Key) -> bool:
        """Record a request for ``key``; True if it is resident (a hit)."""

    @abstractmethod
    def insert(self, key: Key) -> None:
        """Admit a key that is not resident; the caller has made room."""

    @abstractmethod
    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        """Remove and return one resident key for which ``can_evict`` holds.

        ``incoming`` is the key whose miss caused the eviction, when there is one
        (ARC's REPLACE depends on it).
        """

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget a resident key (invalidation, not an eviction); no-op if absent."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (ghosts do not count)."""
