"""A policy addressed by keys alone: libCacheSim's loop, vLLM's ``CachePolicy``, a trace replay.

A tier gives a policy its slots as entries (``policies/base.py``); a caller that has no slots gets them here: each
resident key holds one of ``capacity`` entries, handed out and taken back as keys come and go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tiercache.policies.base import EvictionPolicy, Key


class KeyedPolicy:
    """An ``EvictionPolicy`` driven by keys: ``access``, ``insert``, ``evict`` (returns the key) and ``remove``."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.capacity = policy.capacity
        self._entry: dict[Key, int] = {}
        self._key: list[Key] = [None] * policy.capacity
        self._spare = list(range(policy.capacity - 1, -1, -1))  # entry 0 first

    def access(self, key: Key) -> bool:
        """Record a request for ``key``; True if it is resident (a hit)."""
        entry = self._entry.get(key)
        if entry is None:
            self.policy.miss(key)
            return False
        self.policy.hit(entry)
        return True

    def insert(self, key: Key) -> None:
        """Admit a key that is not resident; the caller has made room (``access`` saw it miss first)."""
        if key in self._entry:
            raise ValueError(f"{key!r} is already resident")
        if not self._spare:
            raise ValueError(f"all {self.capacity} entries are resident: evict first")
        entry = self._spare.pop()
        self._entry[key] = entry
        self._key[entry] = key
        self.policy.insert(entry, key)

    def evict(self, can_evict: Callable[[Key], bool] | None = None, incoming: Key | None = None) -> Key:
        """Remove and return one resident key for which ``can_evict`` holds."""
        keys = self._key
        entry = self.policy.evict(None if can_evict is None else lambda entry: can_evict(keys[entry]), incoming)
        return self._release(entry)

    def remove(self, key: Key) -> None:
        """Forget a resident key (invalidation, not an eviction); no-op if absent."""
        entry = self._entry.get(key)
        if entry is not None:
            self.policy.remove(entry)
            self._release(entry)

    def _release(self, entry: int) -> Key:
        key = self._key[entry]
        del self._entry[key]
        self._key[entry] = None
        self._spare.append(entry)
        return key

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def __iter__(self) -> Iterator[Key]:
        """The resident keys in the policy's order (each list oldest first)."""
        return (self._key[entry] for entry in self.policy)
