"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST '03), counted in blocks.

T1 holds keys seen once recently and T2 keys seen at least twice; the ghost lists
B1 and B2 remember keys recently evicted from each. A miss that hits a ghost
moves the target size ``p`` of T1 toward the list that would have kept the key,
so the cache adapts between recency (scans stay in T1) and frequency.

The paper's steps map onto the interface like this (libCacheSim's ARC does the
same, so the two agree request for request):

- ``access`` is cases I-III: a hit moves the key to T2's MRU end; a ghost hit
  adapts ``p`` (up by max(|B2| / |B1|, 1) for a B1 hit, down by
  max(|B1| / |B2|, 1) for a B2 hit, clamped to [0, c]) and drops the ghost,
  leaving the key to be admitted into T2. ``p`` and the deltas are real numbers,
  as in the paper and libCacheSim (an integer ``p`` gives other results).
- ``evict`` is REPLACE for that ghost hit, or case IV's parts A and B for a
  miss in all four lists (trim a ghost list, then REPLACE; or drop T1's LRU
  outright when T1 fills the whole cache).
- ``insert`` puts the key at T1's MRU end, or T2's after a ghost hit.
"""

from __future__ import annotations

from collections import OrderedDict

from tiercache.policies.base import CanEvict, Key
from tiercache.policies.lru import NO_KEY, TwoListPolicy, oldest_evictable

MIN_ADAPTATION = 1
"""The smallest step of ``p`` on a ghost hit (the paper's delta is at least 1)."""


class ARCPolicy(TwoListPolicy):
    """Four LRU lists (OrderedDicts, oldest first) and the adaptive T1 target ``p``."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0  # target size of T1 in blocks, adapted by ghost hits: 0 <= p <= capacity
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._resident = (self._t1, self._t2)
        # The key whose miss hit a ghost list, until it is inserted (into T2),
        # which list it was in, and whether its REPLACE is still to be done.
        self._ghost_hit: object = NO_KEY
        self._ghost_hit_in_b2 = False
        self._replace_pending = False
        self._room_made = False  # an evict ran since the last insert: no ghost to trim

    def access(self, key: Key) -> bool:
        t1 = self._t1
        if key in t1:
            del t1[key]
            self._t2[key] = None
            return True
        t2 = self._t2
        if key in t2:
            t2.move_to_end(key)
            return True
        b1, b2 = self._b1, self._b2
        if key in b1:
            delta = max(len(b2) / len(b1), MIN_ADAPTATION)
            self.p = min(self.p + delta, float(self.capacity))
            del b1[key]
            self._ghost_hit, self._ghost_hit_in_b2, self._replace_pending = key, False, True
        elif key in b2:
            delta = max(len(b1) / len(b2), MIN_ADAPTATION)
            self.p = max(self.p - delta, 0.0)
            del b2[key]
            self._ghost_hit, self._ghost_hit_in_b2, self._replace_pending = key, True, True
        else:
            self._ghost_hit = NO_KEY
        return False

    def insert(self, key: Key) -> None:
        ghost_hit = self._ghost_hit
        if ghost_hit is not NO_KEY and key == ghost_hit:
            self._ghost_hit = NO_KEY
            self._replace_pending = False
            self._t2[key] = None
            return
        if self._room_made:
            self._room_made = False
        else:
            self._trim_ghosts()
        self._t1[key] = None

    def _trim_ghosts(self) -> None:
        """Keep |T1| + |B1| < c and the directory < 2c before an insert into T1.

        ``evict`` leaves these bounds for the next insert (case IV trims a ghost
        list); an insert into room made otherwise (a ``remove``, or the second
        insert after evicting a batch) trims here instead.
        """
        t1, b1, b2 = self._t1, self._b1, self._b2
        if b1 and len(t1) + len(b1) >= self.capacity:
            b1.popitem(last=False)
        elif b2 and len(t1) + len(self._t2) + len(b1) + len(b2) >= 2 * self.capacity:
            b2.popitem(last=False)

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Key:
        self._room_made = True
        t1, t2, b1 = self._t1, self._t2, self._b1
        if self._replace_pending and incoming == self._ghost_hit:
            self._replace_pending = False
            hit_in_b2 = self._ghost_hit_in_b2
        else:  # case IV: a miss in all four lists
            hit_in_b2 = False
            capacity = self.capacity
            if len(t1) + len(b1) >= capacity:  # case A: L1 = T1 + B1 holds c pages
                if not b1:  # T1 is the whole cache: its LRU page leaves without a ghost
                    return self._pop_evictable(((t1, None), (t2, None)), can_evict)
                b1.popitem(last=False)
            else:  # case B: trim B2 if the directory is full
                b2 = self._b2
                if b2 and len(t1) + len(t2) + len(b1) + len(b2) >= 2 * capacity:
                    b2.popitem(last=False)
        # REPLACE: demote T1's LRU page to B1 if T1 exceeds its target p (or meets
        # it on a B2 hit), else T2's to B2; an empty T2 also picks T1 (libCacheSim).
        n1 = len(t1)
        from_t1 = (n1 and (n1 > self.p or (n1 == self.p and hit_in_b2))) or not t2
        if can_evict is None:
            if from_t1:
                key = t1.popitem(last=False)[0]
                b1[key] = None
            else:
                key = t2.popitem(last=False)[0]
                self._b2[key] = None
            return key
        b2 = self._b2
        return self._pop_evictable(((t1, b1), (t2, b2)) if from_t1 else ((t2, b2), (t1, b1)), can_evict)

    @staticmethod
    def _pop_evictable(
        lists: tuple[tuple[OrderedDict[Key, None], OrderedDict[Key, None] | None], ...],
        can_evict: CanEvict | None,
    ) -> Key:
        """Move the oldest evictable key of the first list that has one to its ghost list.

        Pinned keys are stepped over in place; a ghost list of None drops the key.
        """
        for resident, ghosts in lists:
            key = oldest_evictable(resident, can_evict)
            if key is not None:
                del resident[key]
                if ghosts is not None:
                    ghosts[key] = None
                return key
        raise LookupError("arc: every resident key is pinned")
