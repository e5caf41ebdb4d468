"""2Q, full version (Johnson & Shasha, VLDB '94): A1in FIFO, A1out ghosts, Am LRU.

A new key enters A1in, a FIFO of about ``in_ratio`` of the capacity; hits there
do not promote it (correlated references). When A1in is over its share, its
oldest key is evicted and remembered in A1out, a ghost FIFO of ``out_ratio`` of
the capacity. A missed key found in A1out was re-referenced after a while, so it
enters Am, an LRU; otherwise the victim is Am's LRU key (not remembered).
libCacheSim's TwoQ.c is the same algorithm with the same default ratios.
"""

from __future__ import annotations

from collections import OrderedDict

from tiercache.policies.base import CanEvict, Key
from tiercache.policies.lru import NO_KEY, TwoListPolicy, oldest_evictable, remember


class TwoQPolicy(TwoListPolicy):
    """A1in and A1out FIFOs and the Am LRU (OrderedDicts, oldest first)."""

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
        self._in: OrderedDict[Key, None] = OrderedDict()
        self._out: OrderedDict[Key, None] = OrderedDict()
        self._am: OrderedDict[Key, None] = OrderedDict()
        self._resident = (self._in, self._am)
        self._ghost_hit: object = NO_KEY  # the missed key found in A1out, until inserted

    def access(self, key: Key) -> bool:
        if key in self._in:
            return True
        am = self._am
        if key in am:
            am.move_to_end(key)
            return True
        out = self._out
        if key in out:
            del out[key]
            self._ghost_hit = key
        else:
            self._ghost_hit = NO_KEY
        return False

    def insert(self, key: Key) -> None:
        ghost_hit = self._ghost_hit
        if ghost_hit is not NO_KEY and key == ghost_hit:
            self._ghost_hit = NO_KEY
            self._am[key] = None
        else:
            self._in[key] = None

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        """The paper's reclaimfor: A1in's oldest key (into A1out) if A1in is over its share, else Am's LRU.

        Pinned keys are stepped over; if the chosen queue has none evictable, the other gives one.
        """
        a1in, am = self._in, self._am
        from_in_first = len(a1in) > self.in_capacity or not am
        if can_evict is None:
            if from_in_first:
                key = a1in.popitem(last=False)[0]
                remember(self._out, key, self.out_capacity)
                return key
            return am.popitem(last=False)[0]
        for queue in (a1in, am) if from_in_first else (am, a1in):
            key = oldest_evictable(queue, can_evict)
            if key is not None:
                del queue[key]
                if queue is a1in:
                    remember(self._out, key, self.out_capacity)
                return key
        raise LookupError("twoq: every resident key is pinned")
