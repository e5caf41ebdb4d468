"""An eviction policy outside tiercache, loaded by module path (``policy: support.plugin_policy:FifoPolicy``).

First in, first out: a hit does not move a key. Its own file and nothing else.
"""

from __future__ import annotations

from tiercache.policies.base import CanEvict, EvictionPolicy, Key


class FifoPolicy(EvictionPolicy):
    """Evicts the key admitted longest ago (among those ``can_evict`` allows)."""

    name = "fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: dict[Key, None] = {}

    def access(self, key: Key) -> bool:
        return key in self._order

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        for key in self._order:
            if can_evict is None or can_evict(key):
                del self._order[key]
                return key
        raise LookupError("no evictable key")

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
