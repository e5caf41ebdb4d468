"""Least-recently-used: evict the key whose last access is oldest."""

from __future__ import annotations

from collections import OrderedDict

from tiercache.policies.base import CanEvict, EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """An OrderedDict in recency order: oldest first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key) -> bool:
        if key in self._order:
            self._order.move_to_end(key)
            return True
        return False

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        if can_evict is None:
            return self._order.popitem(last=False)[0]
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        raise LookupError("lru: no evictable key")

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
