"""The local tiers' bookkeeping: where each key lives on the GPU and the CPU, and the pins held on it.

Pure: no threads, no I/O, no bytes. The two ``SlotTable``s keep the ref-count
protocol of DESIGN's "Entry state"; this module answers, position by position,
which local tier can serve each block of a prompt, and keeps the pins a
``Lookup`` holds across both tiers until a load takes them over or the lookup is
released (or dropped unused).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.slots import WRITING, SlotTable


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



class LocalTiers:
    """The GPU pool's and the CPU tier's slot tables, read and pinned together."""

    def __init__(self, gpu: SlotTable, cpu: SlotTable | None) -> None:
        self.gpu = gpu
        self.cpu = cpu

    def locate(self, keys: Sequence[bytes]) -> list[Place | None]:
        """Per position, the fastest local tier holding the key (None where neither does)."""
        gpu, cpu = self.gpu, self.cpu
        places: list[Place | None] = []
        for key in keys:
            block = gpu.readable(key)
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
            self.gpu.pin(place.index)
        elif place.source is Source.CPU:
            self.cpu.pin(place.index)  # type: ignore[union-attr]

    def unpin(self, place: Place) -> None:
        if place.source is Source.GPU:
            self.gpu.unpin(place.index)
        elif place.source is Source.CPU:
            self.cpu.unpin(place.index)  # type: ignore[union-attr]

    def hold(self, run: list[int], lower: list[Place]) -> LookupPins:
        """Pin a lookup's places and return the record of them."""
        for block in run:
            self.gpu.pin(block)
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
        if with_run:
            for block in pins.gpu_run:
                self.gpu.unpin(block)
        return True

    def touch_tail_first(self, table: SlotTable, keys: Sequence[bytes]) -> None:
        """One access per key, the chain's tail first, so the head ends most recent.

        A block is useful only while every block before it is cached, so within a
        chain the tail must be evicted before the head.
        """
        for key in reversed(keys):
            if table.readable(key) is not None:
                table.touch(key)
