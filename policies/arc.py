"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST '03), counted in blocks.

T1 holds keys seen once recently and T2 keys seen at least twice; the ghost lists
B1 and B2 remember keys recently evicted from each. A miss that hits a ghost
moves the target size ``p`` of T1 toward the list that would have kept the key,
so the cache adapts between recency (scans stay in T1) and frequency.

The paper's steps map onto the interface like this (libCacheSim's ARC does the
same, so the two agree request for request):

- ``hit`` and ``miss`` are cases I-III: a hit moves the entry to T2's MRU end; a ghost hit
  adapts ``p`` (up by max(|B2| / |B1|, 1) for a B1 hit, down by
  max(|B1| / |B2|, 1) for a B2 hit, clamped to [0, c]) and drops the ghost,
  leaving the key to be admitted into T2. ``p`` and the deltas are real numbers,
  as in the paper and libCacheSim (an integer ``p`` gives other results).
- ``evict`` is REPLACE for that ghost hit, or case IV's parts A and B for a
  miss in all four lists (trim a ghost list, then REPLACE; or drop T1's LRU
  outright when T1 fills the whole cache).
- ``insert`` puts the entry at T1's MRU end, or T2's after a ghost hit.

B1 and B2 hold fingerprints of keys, not keys (``policies/ghosts.py``).
"""

from __future__ import annotations

from tiercache.policies.base import CanEvict, Entry, Key
from tiercache.policies.ghosts import Ghosts
from tiercache.policies.lists import NOT_LISTED
from tiercache.policies.lru import TwoListPolicy, oldest_evictable

MIN_ADAPTATION = 1
"""The smallest step of ``p`` on a ghost hit (the paper's delta is at least 1)."""

T1, T2 = 0, 1
"""The resident lists."""
B1, B2 = 0, 1
"""The ghost lists."""


class ARCPolicy(TwoListPolicy):
    """Four LRU lists (T1 and T2 of entries, B1 and B2 of ghosts, oldest first) and the adaptive T1 target ``p``."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0  # target size of T1 in blocks, adapted by ghost hits: 0 <= p <= capacity
        self._ghosts = Ghosts(2, expected=capacity)
        # The fingerprint of the key whose miss hit a ghost list, until it is inserted
        # (into T2), which list it was in, and whether its REPLACE is still to be done.
        self._ghost_hit: int | None = None
        self._ghost_hit_in_b2 = False
        self._replace_pending = False
        self._room_made = False  # an evict ran since the last insert: no ghost to trim

    def list_lengths(self) -> tuple[int, int, int, int]:
        """|T1|, |T2|, |B1|, |B2| (the bounds the paper proves)."""
        (t1, t2), (b1, b2) = self._resident.lengths, self._ghosts.lengths
        return t1, t2, b1, b2

    def hit(self, entry: Entry) -> None:
        self._resident.move_to_end(entry, T2)

    def miss(self, key: Key) -> None:
        b1, b2 = self._ghosts.lengths
        fingerprint = hash(key)
        found = self._ghosts.take(fingerprint)
        if found == NOT_LISTED:
            self._ghost_hit = None
            return
        if found == B1:
            self.p = min(self.p + max(b2 / b1, MIN_ADAPTATION), float(self.capacity))
        else:
            self.p = max(self.p - max(b1 / b2, MIN_ADAPTATION), 0.0)
        self._ghost_hit, self._ghost_hit_in_b2, self._replace_pending = fingerprint, found == B2, True

    def insert(self, entry: Entry, key: Key) -> None:
        fingerprint = hash(key)
        if fingerprint == self._ghost_hit:
            self._ghost_hit = None
            self._replace_pending = False
            self._admit(T2, entry, fingerprint)
            return
        if self._room_made:
            self._room_made = False
        else:
            self._trim_ghosts()
        self._admit(T1, entry, fingerprint)

    def _trim_ghosts(self) -> None:
        """Keep |T1| + |B1| < c and the directory < 2c before an insert into T1.

        ``evict`` leaves these bounds for the next insert (case IV trims a ghost
        list); an insert into room made otherwise (a ``remove``, or the second
        insert after evicting a batch) trims here instead.
        """
        t1, t2, b1, b2 = self.list_lengths()
        if b1 and t1 + b1 >= self.capacity:
            self._ghosts.pop_oldest(B1)
        elif b2 and t1 + t2 + b1 + b2 >= 2 * self.capacity:
            self._ghosts.pop_oldest(B2)

    def evict(self, can_evict: CanEvict | None = None, incoming: Key | None = None) -> Entry:
        self._room_made = True
        t1, t2, b1, b2 = self.list_lengths()
        if self._replace_pending and incoming is not None and hash(incoming) == self._ghost_hit:
            self._replace_pending = False
            hit_in_b2 = self._ghost_hit_in_b2
        else:  # case IV: a miss in all four lists
            hit_in_b2 = False
            if t1 + b1 >= self.capacity:  # case A: L1 = T1 + B1 holds c pages
                if not b1:  # T1 is the whole cache: its LRU page leaves without a ghost
                    return self._pop_evictable(((T1, None), (T2, None)), can_evict)
                self._ghosts.pop_oldest(B1)
            elif b2 and t1 + t2 + b1 + b2 >= 2 * self.capacity:  # case B: trim B2 if the directory is full
                self._ghosts.pop_oldest(B2)
        # REPLACE: demote T1's LRU page to B1 if T1 exceeds its target p (or meets
        # it on a B2 hit), else T2's to B2; an empty T2 also picks T1 (libCacheSim).
        from_t1 = (t1 and (t1 > self.p or (t1 == self.p and hit_in_b2))) or not t2
        return self._pop_evictable(((T1, B1), (T2, B2)) if from_t1 else ((T2, B2), (T1, B1)), can_evict)

    def _pop_evictable(self, lists: tuple[tuple[int, int | None], ...], can_evict: CanEvict | None) -> Entry:
        """Move the oldest evictable entry of the first list that has one to its ghost list (None: no ghost).

        Pinned entries are stepped over in place.
        """
        for resident, ghosts in lists:
            entry = oldest_evictable(self._resident, resident, can_evict)
            if entry >= 0:
                self._resident.unlink(entry)
                if ghosts is not None:
                    self._ghosts.append(ghosts, self._fingerprints[entry])
                return entry
        raise LookupError("arc: every resident entry is pinned")
