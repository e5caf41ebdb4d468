"""S3-FIFO (Yang et al., SOSP '23): a small probationary FIFO, a main FIFO, a ghost FIFO.

New keys enter the small FIFO (10% of the capacity); most are one-hit wonders
and leave it quickly, into the ghost FIFO, which remembers only their keys.
A key accessed ``move_to_main_threshold`` times while in the small FIFO moves
to the main FIFO when it reaches the tail; a missed key found in the ghost
enters the main FIFO directly. The main FIFO is a CLOCK with a frequency
capped at 3: a tail key that was accessed is reinserted at the head with its
frequency decremented, one that was not is evicted. Scans therefore pass
through the small FIFO without flushing the main one.

This follows libCacheSim's S3FIFO.c request for request. Where that differs
from the paper's pseudo-code: before the first eviction a key that finds the
small FIFO full goes to main (``insert``); one ``evict`` removes exactly one
key, so a promotion lets main overflow until the next call instead of evicting
from it at once (``evict``); and a key promoted from small starts in main with
frequency 0. The ghost FIFO holds fingerprints of keys, not keys (``policies/ghosts.py``).
"""

from __future__ import annotations

from tiercache.policies.base import CanEvict, Entry, Key
from tiercache.policies.ghosts import Ghosts
from tiercache.policies.lists import NOT_LISTED
from tiercache.policies.lru import TwoListPolicy, remember

MAX_FREQUENCY = 3
"""Access counts saturate here (a 2-bit counter, as in the paper)."""

SMALL, MAIN = 0, 1
"""The resident FIFOs."""


class S3FIFOPolicy(TwoListPolicy):
    """Two resident FIFOs of entries, each entry's frequency in a byte, and a ghost FIFO (oldest first)."""

    name = "s3fifo"

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        move_to_main_threshold: int = 2,
    ) -> None:
        super().__init__(capacity)
        if not 0.0 <= small_ratio < 1.0:
            raise ValueError(f"s3fifo: small_ratio must be in [0, 1), got {small_ratio}")
        if ghost_ratio < 0.0:
            raise ValueError(f"s3fifo: ghost_ratio must be >= 0, got {ghost_ratio}")
        if not 1 <= move_to_main_threshold <= MAX_FREQUENCY:
            raise ValueError(
                f"s3fifo: move_to_main_threshold must be in [1, {MAX_FREQUENCY}], got {move_to_main_threshold}"
            )
        # Sizes truncate the products, as libCacheSim's do.
        self.small_capacity = int(capacity * small_ratio)
        self.main_capacity = capacity - self.small_capacity
        self.ghost_capacity = int(capacity * ghost_ratio)
        self.move_to_main_threshold = move_to_main_threshold
        self._fifos = self._resident
        self._frequency = bytearray(capacity)
        self._ghost = Ghosts(1, expected=self.ghost_capacity)
        self._ghost_hit: int | None = None  # the fingerprint of the missed key found in the ghost, until inserted
        self._has_evicted = False

    def hit(self, entry: Entry) -> None:
        frequency = self._frequency
        if frequency[entry] < MAX_FREQUENCY:
            frequency[entry] += 1  # an entry keeps its place in its FIFO

    def miss(self, key: Key) -> None:
        fingerprint = hash(key)
        self._ghost_hit = fingerprint if self._ghost.take(fingerprint) != NOT_LISTED else None

    def insert(self, entry: Entry, key: Key) -> None:
        """Admit ``key`` into the small FIFO, or the main FIFO after a ghost hit.

        As in libCacheSim (not in the paper): until the first eviction, a key that
        finds the small FIFO full goes to the main FIFO, so the cache fills up
        without pushing the warm-up keys through the small FIFO.
        """
        fingerprint = hash(key)
        if fingerprint == self._ghost_hit:
            self._ghost_hit = None
            fifo = MAIN
        elif not self._has_evicted and self._fifos.lengths[SMALL] >= self.small_capacity:
            fifo = MAIN
        else:
            fifo = SMALL
        self._admit(fifo, entry, fingerprint)
        self._frequency[entry] = 0

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Entry:
        """Evict from the main FIFO while it is over its share (or the small one is empty).

        The paper evicts from the small FIFO when it holds at least its share; in a
        full cache that is the same test. Unlike the paper, a key promoted to the
        main FIFO does not evict from it at once: as in libCacheSim, each call
        removes exactly one key and the main FIFO's overflow is the next victim.
        """
        self._has_evicted = True
        fifos = self._fifos
        if fifos.lengths[MAIN] > self.main_capacity or not fifos.lengths[SMALL]:
            victim = self._evict_main(can_evict)
            if victim < 0:
                victim = self._evict_small(can_evict)
        else:
            victim = self._evict_small(can_evict)
            if victim < 0:
                victim = self._evict_main(can_evict)
        if victim < 0:
            raise LookupError("s3fifo: every resident entry is pinned")
        return victim

    def _evict_small(self, can_evict: CanEvict | None) -> Entry:
        """Promote accessed tail entries to main; evict the first cold one into the ghost.

        A pinned cold entry is rotated to the head of the small FIFO (it gets another
        pass); after a full round of pinned entries, returns -1.
        """
        fifos, frequency = self._fifos, self._frequency
        threshold = self.move_to_main_threshold
        rotated = 0
        while fifos.lengths[SMALL]:
            entry = fifos.oldest(SMALL)
            if frequency[entry] >= threshold:
                fifos.move_to_end(entry, MAIN)
                frequency[entry] = 0  # libCacheSim re-creates the object in main: no credit carried
                continue
            if can_evict is not None and not can_evict(entry):
                if rotated >= fifos.lengths[SMALL]:
                    return -1
                fifos.move_to_end(entry, SMALL)
                rotated += 1
                continue
            fifos.unlink(entry)
            remember(self._ghost, self._fingerprints[entry], self.ghost_capacity)
            return entry
        return -1

    def _evict_main(self, can_evict: CanEvict | None) -> Entry:
        """CLOCK over the main FIFO: reinsert accessed tail entries (frequency - 1), evict a cold one.

        A pinned tail entry is rotated with its frequency intact; after a full round
        of consecutive pinned entries, returns -1.
        """
        fifos, frequency = self._fifos, self._frequency
        pinned_run = 0
        while fifos.lengths[MAIN]:
            entry = fifos.oldest(MAIN)
            if can_evict is not None and not can_evict(entry):
                if pinned_run >= fifos.lengths[MAIN]:
                    return -1
                fifos.move_to_end(entry, MAIN)
                pinned_run += 1
                continue
            pinned_run = 0
            count = frequency[entry]
            if count:
                fifos.move_to_end(entry, MAIN)
                frequency[entry] = count - 1
                continue
            fifos.unlink(entry)
            return entry
        return -1

    def swap(self, first: Entry, second: Entry) -> None:
        super().swap(first, second)
        frequency = self._frequency
        frequency[first], frequency[second] = frequency[second], frequency[first]
