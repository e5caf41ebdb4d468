"""``StagedTransfers``' copies at CUDA's limits and its streams, on CPU tensors through the runtime seam (issue 53):
runs past the maximum pitch, buffers marked for their stream before any copy of theirs is queued, and one stream
per direction whose completions are not held behind the other's.

``HostRuntime`` refuses a pitch past its ``pitch_limit`` as a GPU refuses one
past ``cudaDevAttrMaxPitch``; lowering the limit reaches it with small pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from support.vllm_staging import SMALL, Recording, engine, kv_cache, load, one_group, page, region, store, stored_right

from tiercache.integrations.vllm.connector.cudart import INVALID_VALUE, HostRuntime, MemcpyKind
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.streams import CopyStreams
from tiercache.integrations.vllm.connector.transfers import GroupCopy

LOAD_STREAM, STORE_STREAM = 101, 202
"""The handles ``Handles`` gives each direction's stream."""


def test_a_run_of_whole_slots_past_the_maximum_pitch_is_one_1d_copy_each_way(tmp_path: Path) -> None:
    geometry = one_group(2)  # one rank: a slot is whole pages, so a run of slots is one contiguous piece
    shared = region(tmp_path, geometry)
    runtime = Recording(pitch_limit=2 * geometry.slot_bytes)  # a run of 4 slots is a row twice the device's limit
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=21)
    copies = engine(geometry, kv, shared, runtime=runtime)
    job = GroupCopy(1, 0, (4, 5, 6, 7), (9, 3, 12, 1))
    assert store(copies, [job]) == [] and copies.poll().done == [1], "the run's store lands"
    assert runtime.copies == [(MemcpyKind.DEVICE_TO_HOST, 4 * geometry.slot_bytes, 1, None, None)]
    assert stored_right(shared, geometry, kv, job)
    other = kv_cache(list(geometry.layer_names), **SMALL, seed=22)
    loader = engine(geometry, other, shared, runtime=HostRuntime(pitch_limit=geometry.slot_bytes))
    copies.close()
    assert load(loader, [GroupCopy(2, 0, job.slots, (0, 1, 2, 3))]) == [] and loader.poll().done == [2]
    for name in geometry.layer_names:
        assert [page(other, name, b) for b in range(4)] == [page(kv, name, b) for b in job.blocks]


def test_a_strided_share_past_the_maximum_pitch_is_copied_row_by_row(tmp_path: Path) -> None:
    geometry = one_group(2, world=2)  # each rank's share is half a slot: a run is strided by the slot's size
    shared = region(tmp_path, geometry)
    runtime = Recording(pitch_limit=geometry.slot_bytes - 1)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=23)
    copies = engine(geometry, kv, shared, rank=1, runtime=runtime)
    job = GroupCopy(1, 0, (3, 4, 5), (0, 2, 4))
    assert store(copies, [job]) == [] and copies.poll().done == [1]
    assert runtime.copies == [(MemcpyKind.DEVICE_TO_HOST, geometry.rank_bytes, 1, None, None)] * 3
    assert stored_right(shared, geometry, kv, job, rank=1)


@dataclass
class Ordered(HostRuntime):
    """Logs each copy's device-side range into ``log`` (shared with ``Keeping``); copy number ``fail_at`` fails."""

    log: list[tuple[str, int, int]] = field(default_factory=list)
    fail_at: int = 0
    made: int = 0

    def memcpy(self, dst: int, src: int, count: int, kind: MemcpyKind, stream: int) -> int:
        self.made += 1
        device = dst if kind is MemcpyKind.HOST_TO_DEVICE else src
        self.log.append(("copy", device, device + count))
        if self.made == self.fail_at:
            return self._fail(INVALID_VALUE)
        return super().memcpy(dst, src, count, kind, stream)


class Keeping(CopyStreams):
    """Logs each buffer marked as used by a copy stream, into the runtime's log."""

    def __init__(self, device: torch.device, log: list[tuple[str, int, int]]) -> None:
        super().__init__(device)
        self.log = log

    def keep(self, staging: torch.Tensor, kind: MemcpyKind) -> None:
        self.log.append(("keep", staging.data_ptr(), staging.data_ptr() + staging.numel() * staging.element_size()))
        super().keep(staging, kind)


def kept_before_each_copy(log: list[tuple[str, int, int]]) -> bool:
    """Every copy's device range lies in a buffer marked before it."""
    kept: list[tuple[int, int]] = []
    for what, start, end in log:
        if what == "keep":
            kept.append((start, end))
        elif not any(low <= start and end <= high for low, high in kept):
            return False
    return True


def test_staging_is_marked_for_its_stream_before_a_copy_that_fails_part_way(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    runtime = Ordered(fail_at=2)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=24)
    copies = engine(geometry, kv, shared, runtime=runtime, streams=Keeping(torch.device("cpu"), runtime.log),
                    load_chunk_bytes=2 * geometry.rank_bytes)
    stored = GroupCopy(1, 0, (0, 1, 5, 9), (2, 3, 4, 5))  # two runs: two copies out of one staging buffer
    assert store(copies, [stored]) == [] and copies.poll().failed == [1], "the second copy fails the store"
    assert [what for what, _, _ in runtime.log] == ["keep", "copy", "copy"]
    assert kept_before_each_copy(runtime.log)
    runtime.log.clear()
    runtime.made, runtime.fail_at = 0, 3
    loaded = GroupCopy(2, 0, (0, 2, 4, 6, 8), (1, 2, 3, 4, 5))  # chunks of two slots, a copy a slot
    assert load(copies, [loaded]) == [2], "the third copy (the second chunk's first) fails"
    assert [what for what, _, _ in runtime.log][:2] == ["keep", "keep"], "both chunk buffers, before any copy"
    assert kept_before_each_copy(runtime.log) and runtime.made == 3


class Handles(CopyStreams):
    """CPU streams with a distinct handle per direction, as CUDA's side streams have."""

    def handle(self, kind: MemcpyKind) -> int:
        return LOAD_STREAM if kind is MemcpyKind.HOST_TO_DEVICE else STORE_STREAM


def test_loads_and_stores_are_queued_on_their_own_streams(tmp_path: Path) -> None:
    geometry = one_group(2, world=2)  # strided shares: 2-D copies too
    shared = region(tmp_path, geometry)
    runtime = Recording()
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=25)
    copies = engine(geometry, kv, shared, rank=1, runtime=runtime, streams=Handles(torch.device("cpu")))
    assert store(copies, [GroupCopy(1, 0, (2, 3, 7), (1, 2, 3))]) == []
    stores = len(runtime.streams)
    assert load(copies, [GroupCopy(2, 0, (2, 3, 7), (4, 5, 6))]) == []
    assert runtime.streams[:stores] == [STORE_STREAM] * stores and stores == 2
    assert runtime.streams[stores:] == [LOAD_STREAM] * 2


class StoresLate(StagedTransfers):
    """Store copies stay in flight until ``landed`` (a store stream behind a slow link); loads end at once."""

    landed = False

    def _ended(self, flight: object) -> bool:
        return self.landed or getattr(flight, "kind", None) is MemcpyKind.HOST_TO_DEVICE


def test_a_load_is_reported_while_an_earlier_store_is_still_copying(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=26)
    copies = engine(geometry, kv, shared, kind=StoresLate)
    assert store(copies, [GroupCopy(1, 0, (0, 1), (1, 2))]) == []
    assert load(copies, [GroupCopy(2, 0, (5, 6), (3, 4))]) == []
    first = copies.poll()
    assert first.done == [2] and first.load_bytes and not first.store_bytes, "the load is not behind the store"
    copies.landed = True
    assert copies.poll().done == [1]
