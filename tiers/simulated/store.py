"""The data of one simulated remote, shared (by name) by every client tier that names it."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar

from tiercache.tiers.simulated.link import _Link
from tiercache.tiers.simulated.options import SimulatedOptions


class SimulatedStore:
    """The data and the link of one simulated remote, shared by its client tiers.

    Data is a plain dict touched only from event-loop threads between awaits; the
    link is kept per event loop (each ``TierManager`` runs its own loop).
    """

    _named: ClassVar[dict[str, SimulatedStore]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, options: SimulatedOptions) -> None:
        self.options = options
        self.data: dict[bytes, bytes] = {}
        self._links: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Link] = weakref.WeakKeyDictionary()
        self._clients = 0
        self._watchers: dict[int, Callable[[Sequence[bytes]], None]] = {}

    @classmethod
    def named(cls, name: str, options: SimulatedOptions) -> SimulatedStore:
        """The process-wide store called ``name`` (created with ``options`` on first use)."""
        with cls._named_lock:
            store = cls._named.get(name)
            if store is None:
                store = cls._named[name] = cls(options)
            return store

    @classmethod
    def forget(cls, name: str) -> None:
        """Drop a named store (tests start from an empty one)."""
        with cls._named_lock:
            cls._named.pop(name, None)

    def new_client(self) -> int:
        self._clients += 1
        return self._clients

    def watch(self, client: int, report: Callable[[Sequence[bytes]], None]) -> None:
        """Tell ``report`` the keys this store drops by itself (its bound), until ``unwatch(client)``."""
        self._watchers[client] = report

    def unwatch(self, client: int) -> None:
        self._watchers.pop(client, None)

    def link(self) -> _Link:
        loop = asyncio.get_running_loop()
        link = self._links.get(loop)
        if link is None:
            link = self._links[loop] = _Link(self.options)
        return link

    def save(self, key: bytes, value: bytes) -> None:
        self.data.pop(key, None)
        self.data[key] = value
        capacity = self.options.capacity_blocks
        dropped = []
        while capacity and len(self.data) > capacity:
            oldest = next(iter(self.data))
            del self.data[oldest]
            dropped.append(oldest)
        if dropped:
            for report in list(self._watchers.values()):
                report(dropped)

    def close(self) -> None:
        for link in list(self._links.values()):
            link.close()
