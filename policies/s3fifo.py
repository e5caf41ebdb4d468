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
frequency 0.
"""

from __future__ import annotations

from collections import OrderedDict

from tiercache.policies.base import CanEvict, EvictionPolicy, Key
from tiercache.policies.lru import NO_KEY, remember

MAX_FREQUENCY = 3
"""Access counts saturate here (a 2-bit counter, as in the paper)."""


class S3FIFOPolicy(EvictionPolicy):
    """Two resident FIFOs and a ghost FIFO (OrderedDicts, oldest first); a resident key's value is its frequency.

    The frequency rides in the FIFO that holds the key, not in a map of its own: one table fewer a resident key
    (about 100 bytes a block at a million blocks) and one random access fewer an eviction.
    """

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
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> its frequency
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._ghost_hit: object = NO_KEY  # the missed key found in the ghost, until inserted
        self._has_evicted = False

    def access(self, key: Key) -> bool:
        fifo = self._small
        freq = fifo.get(key)
        if freq is None:
            fifo = self._main
            freq = fifo.get(key)
        if freq is not None:
            if freq < MAX_FREQUENCY:
                fifo[key] = freq + 1  # an existing key keeps its place in its FIFO
            return True
        ghost = self._ghost
        if key in ghost:
            del ghost[key]
            self._ghost_hit = key
        else:
            self._ghost_hit = NO_KEY
        return False

    def insert(self, key: Key) -> None:
        """Admit ``key`` into the small FIFO, or the main FIFO after a ghost hit.

        As in libCacheSim (not in the paper): until the first eviction, a key that
        finds the small FIFO full goes to the main FIFO, so the cache fills up
        without pushing the warm-up keys through the small FIFO.
        """
        ghost_hit = self._ghost_hit
        if ghost_hit is not NO_KEY and key == ghost_hit:
            self._ghost_hit = NO_KEY
            self._main[key] = 0
        elif not self._has_evicted and len(self._small) >= self.small_capacity:
            self._main[key] = 0
        else:
            self._small[key] = 0

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        """Evict from the main FIFO while it is over its share (or the small one is empty).

        The paper evicts from the small FIFO when it holds at least its share; in a
        full cache that is the same test. Unlike the paper, a key promoted to the
        main FIFO does not evict from it at once: as in libCacheSim, each call
        removes exactly one key and the main FIFO's overflow is the next victim.
        """
        self._has_evicted = True
        if len(self._main) > self.main_capacity or not self._small:
            victim = self._evict_main(can_evict)
            if victim is NO_KEY:
                victim = self._evict_small(can_evict)
        else:
            victim = self._evict_small(can_evict)
            if victim is NO_KEY:
                victim = self._evict_main(can_evict)
        if victim is NO_KEY:
            raise LookupError("s3fifo: every resident key is pinned")
        return victim

    def _evict_small(self, can_evict: CanEvict | None) -> object:
        """Promote accessed tail keys to main; evict the first cold one into the ghost.

        A pinned cold key is rotated to the head of the small FIFO (it gets another
        pass); after a full round of pinned keys, returns NO_KEY.
        """
        small, main = self._small, self._main
        threshold = self.move_to_main_threshold
        rotated = 0
        while small:
            key = next(iter(small))
            if small[key] >= threshold:
                del small[key]
                main[key] = 0  # libCacheSim re-creates the object in main: no credit carried
                continue
            if can_evict is not None and not can_evict(key):
                if rotated >= len(small):
                    return NO_KEY
                small.move_to_end(key)
                rotated += 1
                continue
            del small[key]
            remember(self._ghost, key, self.ghost_capacity)
            return key
        return NO_KEY

    def _evict_main(self, can_evict: CanEvict | None) -> object:
        """CLOCK over the main FIFO: reinsert accessed tail keys (frequency - 1), evict a cold one.

        A pinned tail key is rotated with its frequency intact; after a full round
        of consecutive pinned keys, returns NO_KEY.
        """
        main = self._main
        pinned_run = 0
        while main:
            key = next(iter(main))
            if can_evict is not None and not can_evict(key):
                if pinned_run >= len(main):
                    return NO_KEY
                main.move_to_end(key)
                pinned_run += 1
                continue
            pinned_run = 0
            count = main[key]
            if count:
                main.move_to_end(key)
                main[key] = count - 1
                continue
            del main[key]
            return key
        return NO_KEY

    def remove(self, key: Key) -> None:
        if self._small.pop(key, NO_KEY) is NO_KEY:
            self._main.pop(key, None)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main
