"""An eviction policy outside tiercache, loaded by module path (``policy: support.plugin_policy:FifoPolicy``).

First in, first out: a hit does not move an entry. Its own file and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator

from tiercache.policies.base import CanEvict, Entry, EvictionPolicy, Key


class FifoPolicy(EvictionPolicy):
    """Evicts the entry admitted longest ago (among those ``can_evict`` allows)."""

    name = "fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: dict[Entry, None] = {}

    def hit(self, entry: Entry) -> None:
        """FIFO ignores hits."""

    def miss(self, key: Key) -> None:
        """FIFO keeps no ghosts."""

    def insert(self, entry: Entry, key: Key) -> None:
        self._order[entry] = None

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Entry:
        for entry in self._order:
            if can_evict is None or can_evict(entry):
                del self._order[entry]
                return entry
        raise LookupError("no evictable entry")

    def remove(self, entry: Entry) -> None:
        self._order.pop(entry, None)

    def swap(self, first: Entry, second: Entry) -> None:
        renamed = {first: second, second: first}
        self._order = {renamed.get(entry, entry): None for entry in self._order}  # O(resident): a test's policy

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, entry: object) -> bool:
        return entry in self._order

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._order)
