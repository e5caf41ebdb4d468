"""SlotTable: fixed slots, a key index and the ref-count protocol that makes eviction safe.

Both local tiers (the GPU block pool and the pinned-CPU swap space) keep one. Each
slot is in one of these states:

* free: on the free list;
* held: owned by a caller (ref >= 1) and not yet bound to a key (a GPU block the
  engine is computing into);
* writing: bound to a key whose bytes are still arriving (ref == WRITING); not
  readable, not evictable;
* cached: bound and readable; evictable at ref == 0, pinned at ref > 0.

The eviction policy orders the slots (its entries) of cached keys and of the keys a held slot was allocated for
(``allocate_for``: the policy saw their request before it chose a victim, and admitted them; a reserved key is
never a victim), so the table's key index is the only map from keys. ``allocate`` and ``allocate_for`` are
all-or-nothing: they check that enough slots are free or evictable before touching anything.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tiercache.bookkeeping.free_slots import FreeSlots
from tiercache.bookkeeping.slot_checksums import SlotChecksums
from tiercache.policies import EvictionPolicy

WRITING = -1


class CapacityError(RuntimeError):
    """Not enough free or evictable slots; nothing was changed but ``victims`` (see ``allocate``)."""

    def __init__(self, message: str, victims: list[Victim] | None = None) -> None:
        super().__init__(message)
        self.victims: list[Victim] = victims or []


class Victim(NamedTuple):
    """A key evicted to make room: its slot, and whether the slot is kept for a write-back."""

    key: bytes
    slot: int
    retained: bool


class SlotTable:
    """Slot bookkeeping for one local tier (not thread-safe: the manager holds a lock)."""

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self.num_slots = num_slots
        self.policy = policy
        self._free = FreeSlots(num_slots)
        if policy.capacity < num_slots:
            raise ValueError(f"a policy for {policy.capacity} entries cannot order {num_slots} slots")
        self._ref = array("i", bytes(4 * num_slots))
        self._key: list[bytes | None] = [None] * num_slots
        self._slot: dict[bytes, int] = {}
        self._evictable = 0
        self._untracked: set[bytes] = set()
        self._reserved: dict[int, bytes] = {}  # held unbound slot -> the key the policy admitted for it
        self._reserved_slot: dict[bytes, int] = {}  # the inverse
        self._reported: set[bytes] = set()  # bound from a reservation; the holding request's access is counted
        self._checksums = SlotChecksums(num_slots)
        self.evictions = 0

    # ---- queries -------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is bound here, readable or still being written."""
        return key in self._slot

    def readable(self, key: bytes) -> int | None:
        """The slot of ``key`` if its bytes are complete, else None."""
        slot = self._slot.get(key)
        if slot is None or self._ref[slot] == WRITING:
            return None
        return slot

    def slot_of(self, key: bytes) -> int | None:
        return self._slot.get(key)

    def writing(self, key: bytes) -> bool:
        """Whether ``key`` is bound to a slot being written."""
        slot = self._slot.get(key)
        return slot is not None and self._ref[slot] == WRITING

    def key_of(self, slot: int) -> bytes | None:
        return self._key[slot]

    def ref(self, slot: int) -> int:
        return self._ref[slot]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._evictable

    @property
    def num_cached(self) -> int:
        return len(self._slot)

    def occupancy(self) -> dict[str, int]:
        """Slots in all, cached, free and evictable (the tier's numbers in ``stats()``)."""
        return {"capacity_blocks": self.num_slots, "cached_blocks": self.num_cached, "free_blocks": self.num_free,
                "evictable_blocks": self.num_evictable}

    def touch(self, key: bytes, admit: bool = False) -> None:
        """A request for a bound key: a hit if the policy holds its slot, else a miss (admitted if ``admit``)."""
        slot = self._slot[key]
        if slot in self.policy:
            self.policy.hit(slot)
            return
        self.policy.miss(key)
        if admit:
            self.policy.insert(slot, key)

    # ---- state changes -------------------------------------------------------------
    def allocate(
        self,
        count: int,
        incoming: bytes | None = None,
        retain: Callable[[bytes], bool] | None = None,
    ) -> tuple[list[int], list[Victim]]:
        """``count`` held slots (ref 1, unbound), evicting cached ref-0 keys as needed.

        Returns the slots and the victims, in eviction order, for the caller to act
        on (demote, write back). ``incoming`` is the key the room is made for, when
        known (ARC's REPLACE depends on it). A victim for which ``retain(key)`` holds
        leaves the index but keeps its slot, held (ref 1) for a write-back that
        still reads it; it frees when that write ``unpin``s it. Raises CapacityError,
        changing nothing, when free plus evictable slots are fewer than ``count``;
        retained victims can still leave too little room: then the error carries
        the victims taken so far, which stay evicted (their write-backs are due).
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._check_room(count)
        victims: list[Victim] = []
        while len(self._free) < count:
            if not self._evictable:
                raise CapacityError(
                    f"need {count} slots: {len(self._free)} free after {len(victims)} evictions "
                    f"({sum(v.retained for v in victims)} kept for write-back)",
                    victims,
                )
            key, slot = self._evict_one(incoming)
            retained = retain is not None and retain(key)
            if retained:
                self._ref[slot] = 1
            else:
                self._free.append(slot)
            victims.append(Victim(key, slot, retained))
        slots = [self._free.pop() for _ in range(count)]
        for slot in slots:
            self._ref[slot] = 1
        self._checksums.forget(slots)
        return slots, victims

    def _evict_one(self, incoming: bytes | None) -> tuple[bytes, int]:
        slot = self.policy.evict(self._is_evictable, incoming)
        key = self._key[slot]
        del self._slot[key]
        self._key[slot] = None
        self._evictable -= 1
        self.evictions += 1
        return key, slot

    def _is_evictable(self, slot: int) -> bool:
        return self._ref[slot] == 0 and self._key[slot] is not None  # a reserved slot is held: never a victim

    def allocate_for(self, count: int, chain: Sequence[bytes]) -> tuple[list[int], list[Victim]]:
        """``count`` held slots for a request whose keys are ``chain`` (prompt order), and the victims.

        The policy sees the request's keys that are not here before any victim is
        chosen, tail first, each as libCacheSim does (access, evict for it, insert),
        and admits them at once; each is reserved on one of the returned slots, in
        prompt order, until a ``bind`` of that key (whose access is then already
        counted) or the slot's release. Slots past those keys are allocated as by
        ``allocate``. Raises CapacityError, changing nothing, when free plus
        evictable slots are fewer than ``count``.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._check_room(count)
        incoming = [key for key in dict.fromkeys(chain) if key not in self._slot and key not in self._reserved_slot]
        incoming = incoming[:count]
        reserved: dict[bytes, int] = {}
        victims: list[Victim] = []
        policy = self.policy
        for key in reversed(incoming):
            policy.miss(key)  # neither bound nor reserved here: not resident in the policy
            if not self._free:
                victim, slot = self._evict_one(key)
                self._free.append(slot)
                victims.append(Victim(victim, slot, False))
            reserved[key] = slot = self._free.pop()
            policy.insert(slot, key)
            self._ref[slot] = 1
        self._checksums.forget(reserved.values())
        for key in incoming:
            self._reserved[reserved[key]] = key
        self._reserved_slot.update(reserved)
        rest, more = self.allocate(count - len(incoming))
        return [reserved[key] for key in incoming] + rest, victims + more

    def _unreserve(self, slot: int) -> bytes | None:
        key = self._reserved.pop(slot, None)
        if key is not None:
            del self._reserved_slot[key]
        return key

    def _check_room(self, count: int) -> None:
        if count - len(self._free) > self._evictable:
            raise CapacityError(
                f"need {count} slots: {len(self._free)} free and {self._evictable} evictable "
                f"of {self.num_slots} (the rest are pinned or being written)"
            )

    def bind(self, slot: int, key: bytes, *, track: bool = True) -> None:
        """Bind a held slot to ``key`` and make it readable (the caller keeps its pin).

        A key reserved by ``allocate_for`` is already admitted: binding it counts
        nothing (with ``track=False`` the holder's later ``request`` counts nothing
        either). Otherwise, with ``track=False`` the policy does not see the key yet:
        the request that holds the slot reports its whole chain at once later
        (``request``), tail first. A slot reserved for another key gives that
        reservation up (or hands it to the slot reserved for ``key``).
        """
        if self._ref[slot] < 1 or self._key[slot] is not None:
            raise ValueError(f"slot {slot} is not held unbound (ref {self._ref[slot]})")
        if key in self._slot:
            raise ValueError(f"key already bound to slot {self._slot[key]}")
        reserved_here = self._unreserve(slot)
        elsewhere = self._reserved_slot.get(key)
        if elsewhere is not None:  # the engine put the keys in other slots than they were allocated in
            self._unreserve(elsewhere)
            self.policy.swap(elsewhere, slot)  # the key's place moves to its slot (and slot's key to elsewhere)
            if reserved_here is not None:
                self._reserved[elsewhere] = reserved_here
                self._reserved_slot[reserved_here] = elsewhere
        elif reserved_here is not None and reserved_here != key:
            self.policy.remove(slot)
        admitted = elsewhere is not None or reserved_here == key
        self._key[slot] = key
        self._slot[key] = slot
        if admitted:
            if not track:
                self._reported.add(key)
        elif track:
            self.track(key)
        else:
            self._untracked.add(key)

    def track(self, key: bytes) -> None:
        """One request for a bound key: a hit if the policy holds it, else it is admitted."""
        self._untracked.discard(key)
        self.touch(key, admit=True)

    def request(self, key: bytes) -> None:
        """The holding request's access of a bound key, counted once.

        Nothing when ``allocate_for`` admitted it for this request; an admission
        when it was bound untracked; a hit otherwise.
        """
        if key in self._reported:
            self._reported.discard(key)
        elif key in self._untracked:
            self.track(key)
        else:
            self.touch(key)

    def begin_write(
        self, key: bytes, retain: Callable[[bytes], bool] | None = None
    ) -> tuple[int, list[Victim]]:
        """A slot bound to ``key`` in the writing state, and the victims that made room.

        The policy sees the request before a victim is chosen and admits the key at
        once, as libCacheSim does (access, evict, insert), so a tier replaying a
        trace makes exactly the policy's decisions; a writing key is never a victim
        (it is not at ref 0). Raises CapacityError, changing nothing, when no slot
        is free or evictable.
        """
        if key in self._slot:
            raise ValueError("key already present")
        if not self._free and not self._evictable:
            raise CapacityError(f"no free or evictable slot of {self.num_slots}")
        self.policy.miss(key)  # absent from the table: not resident in the policy
        (slot,), victims = self.allocate(1, incoming=key, retain=retain)
        self.policy.insert(slot, key)
        self._key[slot] = key
        self._slot[key] = slot
        self._ref[slot] = WRITING
        return slot, victims

    def commit_write(self, slot: int) -> None:
        """The slot's bytes are complete: it becomes cached and evictable."""
        if self._ref[slot] != WRITING:
            raise ValueError(f"slot {slot} is not being written")
        self._ref[slot] = 0
        self._evictable += 1

    def abort_write(self, slot: int) -> None:
        """Drop a write that failed: the key is forgotten and the slot returns to the free list."""
        self._forget_write(slot)
        self._ref[slot] = 0
        self._free.append(slot)

    def abandon_write(self, slot: int) -> None:
        """Drop a write whose writer may still write into the slot (a read past its deadline): the
        key is forgotten now, the slot stays held (ref 1, unbound) until that writer ``unpin``s it."""
        self._forget_write(slot)
        self._ref[slot] = 1

    def _forget_write(self, slot: int) -> None:
        """Unbind a slot being written from its key (the policy forgets the key too)."""
        if self._ref[slot] != WRITING:
            raise ValueError(f"slot {slot} is not being written")
        key = self._key[slot]
        del self._slot[key]
        self.policy.remove(slot)
        self._key[slot] = None

    def note_checksum(self, slot: int, checksum: int) -> None:
        """Record the ``payload_checksum`` of the bytes just written into a held slot (until it is reallocated)."""
        if self._ref[slot] == 0:
            raise ValueError(f"slot {slot} is not held")
        self._checksums.note(slot, checksum)

    def checksum(self, slot: int) -> int | None:
        """The checksum noted for the slot's current bytes; None if none was."""
        return self._checksums.get(slot)

    def pin(self, slot: int) -> None:
        """Add a reader; a pinned slot is never evicted."""
        ref = self._ref[slot]
        if ref == WRITING:
            raise ValueError(f"slot {slot} is being written")
        if ref == 0:
            if self._key[slot] is None:
                raise ValueError(f"slot {slot} is free")
            self._evictable -= 1
        self._ref[slot] = ref + 1

    def unpin(self, slot: int) -> None:
        """Drop a reader; an unbound slot returns to the free list at ref 0."""
        ref = self._ref[slot]
        if ref < 1:
            raise ValueError(f"slot {slot} is not pinned (ref {ref})")
        self._ref[slot] = ref - 1
        if ref == 1:
            key = self._key[slot]
            if key is None:
                reserved = self._unreserve(slot)
                if reserved is not None:  # allocated for a key the holder never bound
                    self.policy.remove(slot)
                self._free.append(slot)
            else:
                if key in self._untracked:
                    self.track(key)
                self._reported.discard(key)
                self._evictable += 1

    def discard(self, key: bytes) -> bool:
        """Forget an evictable key (exclusive promotion, invalidation); False if pinned or absent."""
        slot = self._slot.get(key)
        if slot is None or self._ref[slot] != 0:
            return False
        del self._slot[key]
        self._key[slot] = None
        self._evictable -= 1
        self.policy.remove(slot)
        self._free.append(slot)
        return True

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "slot on the free list twice"
        evictable = 0
        for slot in range(self.num_slots):
            key, ref = self._key[slot], self._ref[slot]
            if slot in free:
                assert key is None and ref == 0, f"free slot {slot} has key or ref {ref}"
                continue
            if key is None:
                assert ref >= 1, f"unbound slot {slot} is neither free nor held"
                continue
            assert self._slot[key] == slot, f"index disagrees for slot {slot}"
            if ref == 0:
                evictable += 1
        assert evictable == self._evictable, f"evictable count {self._evictable} != {evictable}"
        for slot, key in self._reserved.items():
            assert self._key[slot] is None and self._ref[slot] >= 1, f"reserved slot {slot} is not held unbound"
            assert self._reserved_slot[key] == slot and slot in self.policy, f"reservation of slot {slot} is stale"
        assert len(self._reserved_slot) == len(self._reserved)
        assert len(self._slot) == sum(k is not None for k in self._key)
