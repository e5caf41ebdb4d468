"""2Q, full version (Johnson & Shasha, VLDB '94): A1in FIFO, A1out ghosts, Am LRU.

A new key enters A1in, a FIFO of about ``in_ratio`` of the capacity; hits there
do not promote it (correlated references). When A1in is over its share, its
oldest key is evicted and remembered in A1out, a ghost FIFO of ``out_ratio`` of
the capacity. A missed key found in A1out was re-referenced after a while, so it
enters Am, an LRU; otherwise the victim is Am's LRU key (not remembered).
libCacheSim's TwoQ.c is the same algorithm with the same default ratios. A1out holds
fingerprints of keys, not keys (``policies/ghosts.py``).
"""

from __future__ import annotations

from tiercache.policies.base import CanEvict, Entry, Key
from tiercache.policies.ghosts import Ghosts
from tiercache.policies.lists import NOT_LISTED
from tiercache.policies.lru import TwoListPolicy, oldest_evictable, remember

A1IN, AM = 0, 1
"""The resident lists."""


class TwoQPolicy(TwoListPolicy):
    """The A1in FIFO and the Am LRU of entries, and the A1out FIFO of ghosts (oldest first)."""

    name = "twoq"

    def __init__(self, capacity: int, in_ratio: float = 0.25, out_ratio: float = 0.5) -> None:
        super().__init__(capacity)
        if not 0.0 <= in_ratio < 1.0:
            raise ValueError(f"twoq: in_ratio must be in [0, 1), got {in_ratio}")
        if out_ratio < 0.0:
            raise ValueError(f"twoq: out_ratio must be >= 0, got {out_ratio}")
        # Sizes truncate the products (the paper's Kin and Kout), as libCacheSim's do.
        self.in_capacity = int(capacity * in_ratio)
        self.out_capacity = int(capacity * out_ratio)
        self._out = Ghosts(1, expected=self.out_capacity)
        self._ghost_hit: int | None = None  # the fingerprint of the missed key found in A1out, until inserted

    def hit(self, entry: Entry) -> None:
        if self._resident.list_of(entry) == AM:
            self._resident.move_to_end(entry, AM)

    def miss(self, key: Key) -> None:
        fingerprint = hash(key)
        self._ghost_hit = fingerprint if self._out.take(fingerprint) != NOT_LISTED else None

    def insert(self, entry: Entry, key: Key) -> None:
        fingerprint = hash(key)
        if fingerprint == self._ghost_hit:
            self._ghost_hit = None
            self._admit(AM, entry, fingerprint)
        else:
            self._admit(A1IN, entry, fingerprint)

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Entry:
        """The paper's reclaimfor: A1in's oldest entry (into A1out) if A1in is over its share, else Am's LRU.

        Pinned entries are stepped over; if the chosen queue has none evictable, the other gives one.
        """
        resident = self._resident
        from_in_first = resident.lengths[A1IN] > self.in_capacity or not resident.lengths[AM]
        for queue in (A1IN, AM) if from_in_first else (AM, A1IN):
            entry = oldest_evictable(resident, queue, can_evict)
            if entry >= 0:
                resident.unlink(entry)
                if queue == A1IN:
                    remember(self._out, self._fingerprints[entry], self.out_capacity)
                return entry
        raise LookupError("twoq: every resident entry is pinned")
