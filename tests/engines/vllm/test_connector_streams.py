"""``StagedTransfers``' copies at CUDA's limits, its streams and its staging, on CPU tensors through the runtime seam
(issue 53): runs past the maximum pitch; staging a copy used never let go unmarked for its stream, reserved at
start (or a start-up error), and never staged over while a copy reads it; one stream per direction whose
completions are not held behind the other's.

``HostRuntime`` refuses a pitch past its ``pitch_limit`` as a GPU refuses one
past ``cudaDevAttrMaxPitch``; lowering the limit reaches it with small pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from support.vllm_staging import SMALL, Recording, engine, kv_cache, load, one_group, page, region, store, stored_right

from tiercache.integrations.vllm.connector.cudart import INVALID_VALUE, HostRuntime, MemcpyKind
from tiercache.integrations.vllm.connector.pages import KVPages
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.staging import StagingMemoryError
from tiercache.integrations.vllm.connector.streams import CopyStreams
from tiercache.integrations.vllm.connector.transfers import GroupCopy
from tiercache.integrations.vllm.connector.worker import ConnectorWorker

LOAD_STREAM, STORE_STREAM = 101, 202
"""The handles ``Handles`` gives each direction's stream."""


class StoresLate(StagedTransfers):
    """Store copies stay in flight until ``landed`` (a store stream behind a slow link); loads end at once."""

    landed = False

    def _ended(self, flight: object) -> bool:
        return self.landed or getattr(flight, "kind", None) is MemcpyKind.HOST_TO_DEVICE


def test_a_run_of_whole_slots_past_the_maximum_pitch_is_one_1d_copy_each_way(tmp_path: Path) -> None:
    geometry = one_group(2)  # one rank: a slot is whole pages, so a run of slots is one contiguous piece
    shared = region(tmp_path, geometry)
    runtime = Recording(pitch_limit=2 * geometry.slot_bytes)  # a run of 4 slots is a row twice the device's limit
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=21)
    copies = engine(geometry, kv, shared, runtime=runtime)
    job = GroupCopy(1, 0, (4, 5, 6, 7), (9, 3, 12, 1))
    assert store(copies, [job]) == [] and copies.poll().done == [1], "the run's store lands"
    assert runtime.copies == [] and runtime.batches == [(MemcpyKind.DEVICE_TO_HOST, (4 * geometry.slot_bytes,))]
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
    assert runtime.copies == [] and runtime.batches == [(MemcpyKind.DEVICE_TO_HOST, (geometry.rank_bytes,) * 3)]
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


def held_or_kept(log: list[tuple[str, int, int]], held: list[torch.Tensor]) -> bool:
    """Every copy's device range lies in a buffer the pool still holds, or in one it marked for the copy's stream
    before letting it go (the allocator then reuses it only once that stream has passed the copy)."""
    kept = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in held]
    kept += [(start, end) for what, start, end in log if what == "keep"]
    return all(any(low <= start and end <= high for low, high in kept) for what, start, end in log if what == "copy")


def test_staging_a_copy_used_is_held_or_marked_for_its_stream_when_a_copy_fails_part_way(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    runtime = Ordered(fail_at=2)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=24)
    copies = engine(geometry, kv, shared, runtime=runtime, streams=Keeping(torch.device("cpu"), runtime.log),
                    load_chunk_bytes=4 * geometry.rank_bytes)
    stored = GroupCopy(1, 0, (0, 1, 5, 9), (2, 3, 4, 5))  # three runs: three copies out of one staging buffer
    assert store(copies, [stored]) == [] and copies.poll().failed == [1], "the second copy fails the store"
    assert [what for what, _, _ in runtime.log] == ["keep", "copy", "copy"], "fresh rows: marked before a copy"
    runtime.log.clear()
    runtime.made, runtime.fail_at = 0, 1
    assert load(copies, [GroupCopy(2, 0, (0,), (1,))]) == [2], "a one-slot load fails: its chunk is small"
    runtime.made, runtime.fail_at = 0, 6
    loaded = GroupCopy(3, 0, (0, 2, 4, 6, 8, 10, 12, 14), tuple(range(1, 9)))  # chunks of 4 slots, a copy a slot
    assert load(copies, [loaded]) == [3], "the sixth copy (the second chunk's second) fails"
    log = [what for what, _, _ in runtime.log]
    assert log.count("keep") == 1 and log.index("keep") > log.index("copy"), "the first chunk grown, once"
    held = [buffer.tensor for buffer in copies.pool._loads if buffer.tensor is not None]
    assert runtime.made == 6 and held_or_kept(runtime.log, held)


def test_reserved_staging_is_taken_at_start_and_a_start_that_cannot_afford_it_says_what_to_change(
    tmp_path: Path,
) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=27)
    budget = 4 * geometry.rank_bytes
    copies = engine(geometry, kv, shared, step_budget_bytes=budget)
    assert copies.pool.reserved_bytes == 2 * budget + 2 * (budget // 2), "two steps' stores and two load chunks"
    copies.close()
    with pytest.raises(StagingMemoryError, match=r"staging_mib .*gpu_memory_utilization"):
        engine(geometry, kv, shared, step_budget_bytes=1 << 50)

    class Starving(ConnectorWorker):
        """A worker whose device cannot hold its staging (a CUDA worker's engine, on CPU tensors)."""

        def _engine(self, pages: KVPages, region: SharedRegion) -> StagedTransfers:
            return StagedTransfers(pages, self.geometry, self.rank, region.slots, 1 << 50)

    worker = Starving(geometry, 24, tmp_path / "tiercache-starving-dp0", 0)
    with pytest.raises(StagingMemoryError, match=r"cannot reserve \d+ MiB"):
        worker.register_kv_caches(kv)
    assert not (tmp_path / "tiercache-starving-dp0").exists(), "nothing is left behind"


def test_a_steps_stores_are_dropped_while_an_earlier_steps_copy_reads_their_reserved_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=28)
    copies = engine(geometry, kv, shared, kind=StoresLate, step_budget_bytes=4 * geometry.rank_bytes)
    first, second, third = GroupCopy(1, 0, (0, 1), (1, 2)), GroupCopy(2, 0, (2, 3), (3, 4)), GroupCopy(3, 0, (4,), (5,))
    assert store(copies, [first]) == [] and store(copies, [second]) == [], "the rows in turn: one each"
    with caplog.at_level(logging.WARNING):
        assert store(copies, [third]) == [3], "its rows are the first step's, whose copy still reads them"
    assert "stores not stored" in caplog.text and copies.poll().failed == [3]
    copies.landed = True
    assert sorted(copies.poll().done) == [1, 2]
    assert stored_right(shared, geometry, kv, first) and stored_right(shared, geometry, kv, second)
    fourth = GroupCopy(4, 0, (6, 7), (6, 7))
    assert store(copies, [fourth]) == [] and copies.poll().done == [4] and stored_right(shared, geometry, kv, fourth)


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
