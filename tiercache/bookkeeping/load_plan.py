"""A load's bookkeeping: which source serves each block, the pins it holds, and what changes as blocks land.

Pure: no threads, no I/O, no bytes. A load (``tiercache.movement.loads``) asks
this for its plan, tells it what arrived, and hands its items back when they are
in the engine's blocks or unused. The load's pins and staging slots are kept
here; what the load does to the tiers (the CPU tier's accesses, the blocks it
promotes, what it read from a remote) is told to the ``Hierarchy`` and
``RemoteWrites``. A plan has one item per block, each one of:

* a GPU-resident block later in the prefix (copied on the device, never reloaded
  from below), pinned by the lookup;
* a readable CPU slot, pinned by the lookup (``force_latest`` with a versioned
  remote drops the CPU copy instead, and reads the block again);
* a CPU slot another transfer is writing (the load waits for that write);
* a remote block, read into a staging CPU slot begun here.

The plan stops at the first block that cannot be had any more (no staging room,
a write that failed); the pins of the places it does not use are dropped. An
item's ``gpu_id`` is None when the engine copies out of the CPU slot itself
(``LowerTiers``), so it is never indexed in the GPU pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.memory_tiers import MemoryTiers, Place, Source
from tiercache.bookkeeping.remote_writes import RemoteWrites
from tiercache.bookkeeping.slots import SlotTable
from tiercache.telemetry.counters import Metrics


@dataclass
class LoadItem:
    """One block of a load: where its bytes come from and the GPU block (if any) that receives them."""

    key: bytes
    gpu_id: int | None
    place: Place
    """GPU: the resident block; CPU: the pinned slot; CPU_WRITING: the slot being written; REMOTE: staged."""
    slot: int | None = None
    """The CPU slot the bytes pass through (staging for a remote read)."""
    pinned: bool = False
    """The item holds a pin on its source (the GPU block or the CPU slot) that it must drop."""

    @property
    def cpu_slot(self) -> int:
        """The CPU slot of an item that passes through the CPU tier (every item but a GPU-resident one)."""
        if self.slot is None:
            raise ValueError(f"a load item from {self.place.source.value} has no CPU slot")
        return self.slot

    @property
    def staged(self) -> bool:
        return self.place.source is Source.REMOTE

    @property
    def on_gpu(self) -> bool:
        return self.place.source is Source.GPU


class LoadPlanner:
    """Plans loads and keeps their pins (see the module docstring); call it under the manager's lock."""

    def __init__(
        self, local: MemoryTiers, hierarchy: Hierarchy, remote_writes: RemoteWrites, metrics: Metrics, *,
        has_remotes: bool, versioned_remotes: bool,
    ) -> None:
        self._local = local
        self._hierarchy = hierarchy
        self._remote_writes = remote_writes
        self._metrics = metrics
        self._has_remotes = has_remotes
        self._versioned_remotes = versioned_remotes

    @property
    def _cpu(self) -> SlotTable:
        """The CPU tier's table: a load plan exists only where there is one."""
        cpu = self._local.cpu
        if cpu is None:
            raise RuntimeError("a load needs a CPU tier")
        return cpu

    def plan(
        self, keys: Sequence[bytes], ids: Sequence[int | None], places: Sequence[Place], force_latest: bool
    ) -> list[LoadItem]:
        """Turn a Lookup's lower places (pinned) into load items for ``ids`` (see the module docstring).

        The CPU tier's policy sees the request for the blocks it serves (tail first).
        """
        plan: list[LoadItem] = []
        for position, place in enumerate(places):
            item = None
            if position < len(ids) and len(plan) == position:
                item = self._item(keys[position], ids[position], place, force_latest)
            if item is None:
                self._local.unpin(place)
            else:
                plan.append(item)
        self._hierarchy.served_from_cpu([item.key for item in plan if item.place.source is Source.CPU])
        return plan

    def _item(self, key: bytes, gpu_id: int | None, place: Place, force_latest: bool) -> LoadItem | None:
        cpu = self._cpu
        if place.source is Source.GPU:
            return LoadItem(key, gpu_id, place, pinned=True)
        if place.source is Source.CPU:
            if not (force_latest and self._versioned_remotes):
                return LoadItem(key, gpu_id, place, slot=place.index, pinned=True)
            self._local.unpin(place)
            if not cpu.discard(key):
                self._local.pin(place)
                return None
            return self._staged(key, gpu_id)
        slot = cpu.readable(key)
        if slot is not None:
            cpu.pin(slot)
            return LoadItem(key, gpu_id, Place(Source.CPU, slot), slot=slot, pinned=True)
        writing = cpu.slot_of(key)
        if writing is not None:
            return LoadItem(key, gpu_id, Place(Source.CPU_WRITING, writing))
        return self._staged(key, gpu_id) if self._has_remotes else None

    def _staged(self, key: bytes, gpu_id: int | None) -> LoadItem | None:
        """A remote read into a fresh CPU slot (None when the CPU tier has no room)."""
        slot = self._hierarchy.begin_remote_read(key)
        if slot is None:
            self._metrics.add(self._hierarchy.cpu_name, "load_staging_full")
            return None
        return LoadItem(key, gpu_id, Place(Source.REMOTE, 0), slot=slot)

    def arrived(self, items: Sequence[LoadItem], sources: Sequence[int | None], unsettled: Sequence[int]) -> None:
        """A remote read of staged ``items`` ended: ``sources[i]`` is the lane that filled item i (None: not
        filled). Filled slots are committed and pinned for the load, the rest aborted; the slots of ``unsettled``
        positions (a read past its deadline may still write into them) leave the index now and stay reserved
        until ``late_read_ended``. Blocks read from a slower lane are written into the faster ones."""
        cpu = self._cpu
        held = set(unsettled)
        ending = [i for i in range(len(items)) if i not in held]
        self._hierarchy.end_remote_reads([items[i].cpu_slot for i in ending], [sources[i] is not None for i in ending])
        for i in held:
            cpu.abandon_write(items[i].cpu_slot)
        by_lane: dict[int, list[LoadItem]] = {}
        for item, source in zip(items, sources, strict=True):
            if source is not None:
                cpu.pin(item.cpu_slot)
                item.pinned = True
                by_lane.setdefault(source, []).append(item)
        for lane, group in sorted(by_lane.items()):
            self._remote_writes.fetched(lane, [item.key for item in group], [item.cpu_slot for item in group])

    def late_read_ended(self, slots: Sequence[int]) -> None:
        """A read past its deadline has ended: the slots it could write into are free again."""
        for slot in slots:
            self._cpu.unpin(slot)

    def fill_landed(self, item: LoadItem) -> bool:
        """The CPU write ``item`` waited for succeeded: pin the slot it landed in (False: gone meanwhile)."""
        cpu = self._cpu
        slot = cpu.readable(item.key)
        if slot is None:
            return False
        cpu.pin(slot)
        item.slot, item.pinned = slot, True
        return True

    def handed_over(self, items: Sequence[LoadItem]) -> None:
        """``items`` are in their GPU blocks: their sources' pins go, and the hierarchy hears of the promotion."""
        self.release(items)
        below = [(item.key, item.gpu_id) for item in items if not item.on_gpu]
        self._hierarchy.promoted(below, len(items) - len(below))

    def release(self, items: Sequence[LoadItem]) -> None:
        """Give back the pins ``items`` hold on their sources (which stay cached)."""
        for item in items:
            if not item.pinned:
                continue
            item.pinned = False
            if item.on_gpu:
                self._local.pool.unpin(item.place.index)
            else:
                self._cpu.unpin(item.cpu_slot)
