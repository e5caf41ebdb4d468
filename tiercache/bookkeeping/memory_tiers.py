"""The memory tiers' bookkeeping: where each key lives in GPU and pinned-CPU memory, and the pins held on it.

Pure: no threads, no I/O, no bytes. The two ``SlotTable``s keep the ref-count
protocol of docs/architecture.md, "Entry state"; this module answers, position by position,
which memory tier can serve each block of a prompt, and keeps the pins a
``Lookup`` holds across both tiers until a load takes them over or the lookup is
released (or dropped unused), and the GPU blocks the engine itself holds.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.bookkeeping.slots import WRITING, SlotTable


class Source(enum.Enum):
    """Where one block of a lookup's prefix comes from."""

    GPU = "gpu"
    """Resident in the GPU pool (copied on the device when not in the leading run)."""
    CPU = "cpu"
    """Readable in the pinned-CPU tier (pinned by the lookup)."""
    CPU_WRITING = "cpu_writing"
    """Being written into the CPU tier (a demotion or a remote read in flight)."""
    REMOTE = "remote"
    """Held by a remote tier only (``lane`` says which)."""


@dataclass(frozen=True)
class Place:
    """One position of a prefix: its source, and the GPU block, CPU slot or remote lane there."""

    source: Source
    index: int

    @staticmethod
    def remote(lane: int | None) -> Place | None:
        """The place of a block a remote lane holds (None: no lane holds it)."""
        return None if lane is None else Place(Source.REMOTE, lane)


class PinState(enum.Enum):
    HELD = "held"
    """The lookup still holds every pin."""
    LOADED = "loaded"
    """``load`` took the lower pins over; the GPU run belongs to the caller's block table."""
    RELEASED = "released"
    """``release(hit)`` (or the lookup's garbage collection) dropped them."""


@dataclass
class LookupPins:
    """The local pins one Lookup holds.

    ``gpu_run``: the leading GPU-resident blocks (handed to the caller, who
    releases them with its block table). ``lower``: the lookup's other places,
    pinned where local, taken over by ``load``. ``state`` says who owns them now.
    """

    gpu_run: list[int]
    lower: list[Place]
    state: PinState = PinState.HELD



class EngineHolds:
    """The GPU blocks the engine holds, counted per block: from ``allocate`` and from a Lookup's leading run.

    Each hold is one pin on the block. ``store`` and ``load`` take only blocks the
    engine holds and ``release`` gives holds back; ``checked`` refuses a list of ids
    as a whole (duplicated, out of range, not held) before anything changes.
    """

    def __init__(self, gpu: SlotTable | None) -> None:
        self.gpu = gpu
        self._count = [0] * (gpu.num_slots if gpu is not None else 0)

    def give(self, blocks: Sequence[int]) -> None:
        """The engine now holds ``blocks`` (each already pinned once for it)."""
        for block in blocks:
            self._count[block] += 1

    def count(self, block: int) -> int:
        """How many holds the engine has on ``block``."""
        return self._count[block]

    def checked(self, call: str, ids: Sequence[int]) -> list[int]:
        """``ids`` as ints; ValueError (naming ``call``) if one is duplicated, out of range or not held."""
        blocks: list[int] = []
        seen: set[int] = set()
        size = len(self._count)
        for raw in ids:
            try:
                block = operator.index(raw)
            except TypeError:
                raise TypeError(f"{call}: GPU block ids must be integers, got {raw!r}") from None
            if not 0 <= block < size:
                raise ValueError(f"{call}: GPU block {block} is out of range (the pool has blocks 0..{size - 1})")
            if block in seen:
                raise ValueError(f"{call}: GPU block {block} is listed twice (duplicate ids)")
            if not self._count[block]:
                raise ValueError(f"{call}: GPU block {block} is not held by the caller")
            seen.add(block)
            blocks.append(block)
        return blocks

    def take_back(self, blocks: Sequence[int]) -> None:
        """The engine gives one hold on each of ``blocks`` back (checked first)."""
        for block in blocks:
            self._count[block] -= 1
            self.gpu.unpin(block)  # type: ignore[union-attr] - a block held means there is a pool


class MemoryTiers:
    """The GPU pool's and the CPU tier's slot tables (the tiers in memory, not the stores below them), read and
    pinned together, and the engine's holds.

    ``gpu`` is None for ``LowerTiers``: the engine keeps its own pool, which tiercache does not index.
    """

    def __init__(self, gpu: SlotTable | None, cpu: SlotTable | None) -> None:
        self.gpu = gpu
        self.cpu = cpu
        self.holds = EngineHolds(gpu)

    @property
    def pool(self) -> SlotTable:
        """The GPU pool's table, for what only a pool tiercache manages does (allocate, store, promote)."""
        if self.gpu is None:
            raise RuntimeError("the engine keeps its own GPU pool: tiercache indexes only the tiers below it")
        return self.gpu

    def locate(self, keys: Sequence[bytes]) -> list[Place | None]:
        """Per position, the fastest local tier holding the key (None where neither does)."""
        gpu, cpu = self.gpu, self.cpu
        places: list[Place | None] = []
        for key in keys:
            block = gpu.readable(key) if gpu is not None else None
            if block is not None:
                places.append(Place(Source.GPU, block))
                continue
            slot = cpu.slot_of(key) if cpu is not None else None
            if slot is None:
                places.append(None)
            elif cpu.ref(slot) == WRITING:  # type: ignore[union-attr]
                places.append(Place(Source.CPU_WRITING, slot))
            else:
                places.append(Place(Source.CPU, slot))
        return places

    @staticmethod
    def prefix(places: Sequence[Place | None]) -> tuple[list[int], list[Place]]:
        """The longest prefix every position of which some tier holds: its leading GPU run, then the rest."""
        end = next((i for i, place in enumerate(places) if place is None), len(places))
        found: list[Place] = places[:end]  # type: ignore[assignment]
        run = next((i for i, place in enumerate(found) if place.source is not Source.GPU), len(found))
        return [place.index for place in found[:run]], found[run:]

    def pin(self, place: Place) -> None:
        """Pin a local place (a writing CPU slot cannot be pinned and is left alone)."""
        if place.source is Source.GPU:
            self.pool.pin(place.index)
        elif place.source is Source.CPU:
            self.cpu.pin(place.index)  # type: ignore[union-attr]

    def unpin(self, place: Place) -> None:
        if place.source is Source.GPU:
            self.pool.unpin(place.index)
        elif place.source is Source.CPU:
            self.cpu.unpin(place.index)  # type: ignore[union-attr]

    def hold(self, run: list[int], lower: list[Place]) -> LookupPins:
        """Pin a lookup's places and return the record of them; the leading GPU run is the engine's to hold."""
        for block in run:
            self.pool.pin(block)
        self.holds.give(run)
        for place in lower:
            self.pin(place)
        return LookupPins(run, lower)

    def drop(self, pins: LookupPins, *, with_run: bool) -> bool:
        """Drop a still-held lookup's pins (the GPU run too when ``with_run``); False if not held."""
        if pins.state is not PinState.HELD:
            return False
        pins.state = PinState.RELEASED
        for place in pins.lower:
            self.unpin(place)
        if with_run:  # what the engine already released of the run is not given back twice
            self.holds.take_back([block for block in pins.gpu_run if self.holds.count(block)])
        return True

    def touch_tail_first(self, table: SlotTable, keys: Sequence[bytes]) -> None:
        """One access per key, the chain's tail first, so the head ends most recent.

        A block is useful only while every block before it is cached, so within a
        chain the tail must be evicted before the head.
        """
        for key in reversed(keys):
            if table.readable(key) is not None:
                table.touch(key)
