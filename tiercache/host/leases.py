"""What one attached engine holds on the host server, so that an engine that goes away leaves nothing pinned.

Pure bookkeeping (no threads, no I/O; the server's connection thread owns
one): the hits it looked up and has not fetched or released, the fetches whose
slots it has not released, the CPU slots it was given to write and has not
ended, the askers whose presence answers are kept for it. The engine names
them by the ids handed out here, so it can release only what is its own, and
``drain`` gives the server everything left when the connection ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Hit = TypeVar("Hit")
Fetch = TypeVar("Fetch")


@dataclass
class Leftovers(Generic[Hit, Fetch]):
    """What an engine still held when it went away: the server releases hits and fetches, fails the writes."""

    hits: list[Hit] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)
    write_keys: list[bytes] = field(default_factory=list)
    write_slots: list[int] = field(default_factory=list)
    askers: list[Hashable] = field(default_factory=list)


class Leases(Generic[Hit, Fetch]):
    """One engine's hits, fetches, writes and askers on the server (see the module docstring)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._hits: dict[int, Hit] = {}
        self._fetches: dict[int, Fetch] = {}
        self._writes: dict[bytes, int] = {}
        self._askers: set[Hashable] = set()

    def add_hit(self, hit: Hit) -> int:
        hit_id = next(self._ids)
        self._hits[hit_id] = hit
        return hit_id

    def take_hit(self, hit_id: int) -> Hit | None:
        """The hit, no longer leased (None: not this engine's, or fetched or released already)."""
        return self._hits.pop(hit_id, None)

    def add_fetch(self, fetch: Fetch) -> int:
        fetch_id = next(self._ids)
        self._fetches[fetch_id] = fetch
        return fetch_id

    def take_fetch(self, fetch_id: int) -> Fetch | None:
        return self._fetches.pop(fetch_id, None)

    def begin_writes(self, keys: Sequence[bytes], slots: Sequence[int | None]) -> None:
        """The server gave ``slots`` (None: not given) for ``keys``."""
        for key, slot in zip(keys, slots, strict=True):
            if slot is not None:
                self._writes[key] = slot

    def end_writes(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]
                   ) -> tuple[list[bytes], list[int], list[bool]]:
        """Of the writes the engine ends, those it was given (that key into that slot), no longer leased."""
        ended: tuple[list[bytes], list[int], list[bool]] = ([], [], [])
        for key, slot, ok in zip(keys, slots, oks, strict=True):
            if self._writes.get(key) == slot:
                del self._writes[key]
                ended[0].append(key)
                ended[1].append(slot)
                ended[2].append(bool(ok))
        return ended

    def asked(self, asker: Hashable) -> None:
        self._askers.add(asker)

    def forgot(self, asker: Hashable) -> None:
        self._askers.discard(asker)

    def counts(self) -> dict[str, int]:
        """Leases held now, by kind (the server's stats)."""
        return {"hits": len(self._hits), "fetches": len(self._fetches), "writes": len(self._writes),
                "askers": len(self._askers)}

    def drain(self) -> Leftovers[Hit, Fetch]:
        """Everything still leased, and nothing leased any more."""
        left: Leftovers[Hit, Fetch] = Leftovers(list(self._hits.values()), list(self._fetches.values()),
                                                 list(self._writes), list(self._writes.values()), list(self._askers))
        self._hits.clear()
        self._fetches.clear()
        self._writes.clear()
        self._askers.clear()
        return left
