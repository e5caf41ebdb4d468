"""The CUDA transfer engine (``StagedTransfers``) on CPU tensors: how it pins host memory, how it copies, what it
does when a registration or a copy fails, and when a failed job is reported.

The engine runs its GPU code paths here: ``HostRuntime`` answers the CUDA runtime's
calls on host memory (registrations recorded and refused where CUDA refuses
them, ``cudaMemcpy2DAsync`` done row by row at the same addresses), and a test
that needs a refusal or a failing copy hands it a runtime that refuses
(``support.vllm_staging``). The regions are real (``SharedRegion`` files), the
KV caches vLLM's token-major layout (LBNHC) with random bytes; every copy is
checked byte for byte against the page in vLLM's logical order.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from support.vllm_staging import (
    BLOCKS,
    LARGE,
    SMALL,
    TOKENS,
    Late,
    Recording,
    Refusing,
    engine,
    hybrid,
    kv_cache,
    load,
    one_group,
    page,
    region,
    store,
    stored_right,
)
from torch.profiler import ProfilerActivity, profile

from tiercache.integrations.vllm.connector.cudart import HostRuntime, MemcpyKind
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata
from tiercache.integrations.vllm.connector.pages import KVPages, page_views
from tiercache.integrations.vllm.connector.pinning import HostPins, PinScope, copy_runs, plan_pins
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.step_budget import step_blocks, store_budget_bytes
from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy
from tiercache.integrations.vllm.connector.worker import ConnectorWorker


def test_a_refused_registration_clears_its_error_and_copies_go_through_bounce_buffers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    geometry = one_group(3)
    shared = region(tmp_path, geometry)
    runtime = HostRuntime()
    assert runtime.host_register(shared.slots.data_ptr(), shared.slots.numel()) == 0  # someone pinned it first
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=1)
    copies = engine(geometry, kv, shared, runtime=runtime)
    assert not copies.pinned and runtime.error == 0, "refused (already registered), and the error cleared"
    assert "cudaHostRegister refused" in caplog.text and "bounce buffers" in copies.describe()
    job = GroupCopy(1, 0, (7, 2, 3, 11), (5, 9, 10, 0))
    before = bytes(shared.slots[7].numpy())
    assert store(copies, [job]) == [] and bytes(shared.slots[7].numpy()) == before, "the host's scatter waits"
    assert copies.poll().done == [1] and stored_right(shared, geometry, kv, job)
    other = kv_cache(list(geometry.layer_names), **SMALL, seed=2)
    loader = engine(geometry, other, shared, runtime=runtime)
    assert load(loader, [GroupCopy(2, 0, job.slots, (1, 2, 3, 4))]) == [] and loader.poll().done == [2]
    for name in geometry.layer_names:
        assert [page(other, name, b) for b in (1, 2, 3, 4)] == [page(kv, name, b) for b in job.blocks]


def test_registration_is_chunked_on_slot_and_page_boundaries_and_rolled_back_when_one_is_refused(
    tmp_path: Path,
) -> None:
    geometry = one_group(3)  # 6 KiB slots: a page boundary every 2 slots
    shared = region(tmp_path, geometry, slots=20)
    plan = plan_pins(shared.slots, 0, geometry.slot_bytes, page=4096, max_bytes=5 * geometry.slot_bytes)
    assert plan.scope is PinScope.WHOLE and plan.slots_per_range == 4 and len(plan.ranges) == 5
    starts = [address for address, _ in plan.ranges]
    assert all(address % 4096 == 0 for address in starts)
    assert all(a + size == b for (a, size), b in zip(plan.ranges, starts[1:], strict=False)), "back to back"
    assert starts[1] == shared.slots[4].data_ptr(), "a chunk ends where a slot starts"
    assert copy_runs([(p, p + 2) for p in range(6)], plan) == [(0, 2, 2), (2, 4, 4)], "no copy spans two chunks"
    runtime = HostRuntime()
    runtime.host_register(starts[3], 4096)  # a page of the fourth chunk is pinned already
    assert HostPins.register(runtime, plan) is None
    assert runtime.registered == {starts[3]: 4096} and runtime.error == 0, "rolled back, the error cleared"
    pins = HostPins.register(HostRuntime(), plan)
    assert pins is not None and len(pins.runtime.registered) == 5
    pins.close()
    assert pins.runtime.registered == {}, "unregistered at close"


def test_each_rank_pins_only_its_shares_where_that_saves_enough_and_two_ranks_share_the_slots(
    tmp_path: Path,
) -> None:
    geometry = one_group(3, world=2, page=2 * TOKENS * LARGE["content"])
    shared = region(tmp_path, geometry, slots=8)
    runtime = HostRuntime()  # one process, one mapping: both ranks' registrations must not overlap
    caches = [kv_cache(list(geometry.layer_names), **LARGE, seed=rank) for rank in range(2)]
    ranks = [engine(geometry, caches[rank], shared, rank, runtime=runtime) for rank in range(2)]
    for rank, copies in enumerate(ranks):
        assert copies.pins is not None and copies.pins.plan.scope is PinScope.SHARES
        share = geometry.offset(rank, 0, 0)
        assert copies.pins.plan.ranges == tuple((shared.slots[slot, share:].data_ptr(), geometry.rank_bytes)
                                                for slot in range(8))
    job = GroupCopy(1, 0, (3, 4, 0), (2, 6, 7))
    for copies in ranks:
        assert store(copies, [job]) == [] and copies.poll().done == [1]
    assert all(stored_right(shared, geometry, caches[rank], job, rank) for rank in range(2))
    small = one_group(3, world=2)
    whole = SharedRegion.for_worker(tmp_path / "tiercache-small-dp0", 8, small.slot_bytes, 0)
    assert plan_pins(whole.slots, 0, small.rank_bytes).scope is PinScope.WHOLE, "a 6 KiB saving: the whole region"


def test_a_rank_pinning_its_shares_copies_a_step_in_one_batch_not_one_call_a_slot(tmp_path: Path) -> None:
    geometry = one_group(3, world=2, page=2 * TOKENS * LARGE["content"])  # each share registered on its own
    shared = region(tmp_path, geometry, slots=8)
    runtime = Recording()
    kv = kv_cache(list(geometry.layer_names), **LARGE, seed=6)
    copies = engine(geometry, kv, shared, rank=1, runtime=runtime)
    assert copies.pins is not None and copies.pins.plan.scope is PinScope.SHARES
    job = GroupCopy(1, 0, (3, 4, 5, 0), (2, 6, 7, 1))
    assert store(copies, [job]) == [] and copies.poll().done == [1]
    assert runtime.copies == [] and runtime.batches == [(MemcpyKind.DEVICE_TO_HOST, (geometry.rank_bytes,) * 4)]
    assert stored_right(shared, geometry, kv, job, rank=1)
    other = kv_cache(list(geometry.layer_names), **LARGE, seed=7)
    copies.close()
    loader = engine(geometry, other, shared, rank=1, runtime=runtime)
    assert load(loader, [GroupCopy(2, 0, job.slots, (0, 3, 4, 5))]) == [] and loader.poll().done == [2]
    assert runtime.copies == [] and runtime.batches[1:] == [(MemcpyKind.HOST_TO_DEVICE, (geometry.rank_bytes,) * 4)]
    for name in geometry.layer_names:
        assert [page(other, name, block) for block in (0, 3, 4, 5)] == [page(kv, name, block) for block in job.blocks]


def test_a_second_engine_over_the_same_memory_is_pinned_once_the_first_closed(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    runtime = HostRuntime()
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=3)
    first = engine(geometry, kv, shared, runtime=runtime)
    second = engine(geometry, kv, shared, runtime=runtime)
    assert first.pinned and not second.pinned and runtime.error == 0, "CUDA: already registered"
    second.close()
    first.close()
    assert runtime.registered == {}
    third = engine(geometry, kv, shared, runtime=runtime)
    assert third.pinned, "close unregistered what the first one pinned"


def test_runs_of_slots_strided_alike_are_one_2d_copy_each_and_a_lone_slot_one_1d_copy(tmp_path: Path) -> None:
    geometry = one_group(2, world=2)  # each rank's share is half a slot: strided in the slots
    shared = region(tmp_path, geometry)
    runtime = Recording()
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=4)
    copies = engine(geometry, kv, shared, rank=1, runtime=runtime)
    job = GroupCopy(1, 0, (3, 4, 5, 6, 10, 11, 20), (0, 2, 4, 6, 8, 10, 12))
    assert store(copies, [job]) == [] and copies.poll().done == [1]
    width = geometry.rank_bytes
    assert runtime.copies == [(MemcpyKind.DEVICE_TO_HOST, width, 4, geometry.slot_bytes, width),
                              (MemcpyKind.DEVICE_TO_HOST, width, 2, geometry.slot_bytes, width)]
    assert runtime.batches == [(MemcpyKind.DEVICE_TO_HOST, (width,))]
    assert stored_right(shared, geometry, kv, job, rank=1)


def test_a_failing_copy_fails_its_jobs_alone_clears_the_error_and_is_reported_once(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    runtime = Refusing(refuse=MemcpyKind.DEVICE_TO_HOST)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=5)
    copies = engine(geometry, kv, shared, runtime=runtime)
    assert store(copies, [GroupCopy(1, 0, (1, 2), (3, 4))]) == []
    completed = copies.poll()
    assert completed.failed == [1] and completed.done == [] and runtime.error == 0
    assert copies.poll().failed == [], "reported once"
    runtime.refuse = MemcpyKind.HOST_TO_DEVICE
    assert load(copies, [GroupCopy(2, 0, (1, 2), (5, 6))]) == [2], "the load's blocks are recomputed at once"
    assert copies.poll().failed == [2] and runtime.error == 0


def test_ids_out_of_range_fail_their_job_before_anything_is_copied(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=6)
    copies = engine(geometry, kv, shared)
    before = shared.slots.clone()
    assert store(copies, [GroupCopy(1, 0, (1, 2), (3, BLOCKS))]) == [1]
    assert load(copies, [GroupCopy(2, 0, (1, 10**6), (3, 4))]) == [2]
    assert copies.poll().failed == [1, 2] and torch.equal(shared.slots, before)


def ops(run: object) -> list[str]:
    """The top-level torch ops a call ran (CPU profiler)."""
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        run()  # type: ignore[operator]
    return [event.name for event in profiled.events() if event.name in ("aten::index_select", "aten::copy_",
                                                                          "aten::empty", "aten::index")]


def test_a_layers_stores_are_one_gather_straight_into_staging(tmp_path: Path) -> None:
    geometry = one_group(3)
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=7)
    copies = engine(geometry, kv, shared)
    job = GroupCopy(1, 0, (0, 5, 9), (1, 8, 3))
    assert "aten::empty" in ops(lambda: copies.store_layer(0, [job])), "the first layer makes the staging"
    for layer in (1, 2):
        assert ops(lambda layer=layer: copies.store_layer(layer, [job])) == ["aten::index_select"]
    copies.end_step([], [1])
    assert copies.poll().done == [1] and stored_right(shared, geometry, kv, job)


def test_loads_are_staged_in_bounded_chunks(tmp_path: Path) -> None:
    geometry = one_group(2)
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=8)
    runtime = Recording()
    writer = engine(geometry, kv, shared, runtime=runtime)
    job = GroupCopy(1, 0, tuple(range(10)), (15, 14, 13, 12, 11, 10, 9, 8, 7, 6))
    assert store(writer, [job]) == []
    writer.close()
    other = kv_cache(list(geometry.layer_names), **SMALL, seed=9)
    runtime.batches.clear()
    loader = engine(geometry, other, shared, runtime=runtime, load_chunk_bytes=3 * geometry.rank_bytes)
    assert load(loader, [GroupCopy(2, 0, job.slots, tuple(range(10)))]) == [] and loader.poll().done == [2]
    assert runtime.batches == [(MemcpyKind.HOST_TO_DEVICE, (3 * geometry.rank_bytes,))] * 3 + [
        (MemcpyKind.HOST_TO_DEVICE, (geometry.rank_bytes,))], "4 chunks of at most 3 slots, a run each"
    for name in geometry.layer_names:
        assert [page(other, name, b) for b in range(10)] == [page(kv, name, b) for b in job.blocks]


def test_a_hybrid_store_failing_in_one_group_copies_nothing_of_that_job(tmp_path: Path) -> None:
    geometry = hybrid()
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=10)
    copies = engine(geometry, kv, shared)
    shared.slots.fill_(0xAB)
    good = [GroupCopy(1, 0, (0, 1), (2, 3)), GroupCopy(1, 1, (2,), (3,))]
    bad = [GroupCopy(2, 0, (4, 5), (6, 7)), GroupCopy(2, 1, (6,), (BLOCKS + 1,))]  # group 1's block is no block
    assert store(copies, [*good, *bad]) == [2], "failed in group 1, after group 0 had gathered it"
    completed = copies.poll()
    assert completed.failed == [2] and completed.done == [1]
    assert bool((shared.slots[4:7] == 0xAB).all()), "no copy of the failed job was launched, in any group"
    assert stored_right(shared, geometry, kv, good[0]) and stored_right(shared, geometry, kv, good[1])


def test_a_hybrid_load_failing_in_one_group_is_reported_once_its_other_groups_copies_ended(tmp_path: Path) -> None:
    geometry = hybrid()
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=11)
    copies = engine(geometry, kv, shared, kind=Late)
    jobs = [GroupCopy(1, 0, (0, 1), (2, 3)), GroupCopy(1, 1, (2,), (3,)),
            GroupCopy(2, 0, (3, 4), (4, 5)), GroupCopy(2, 1, (10**6,), (5,))]
    assert load(copies, jobs) == [2], "its blocks are recomputed in this step"
    assert copies.poll() == Completed(), "group 0's copy of job 2 is still in flight: its slots stay held"
    copies.landed = True
    completed = copies.poll()
    assert completed.done == [1] and completed.failed == [2]
    assert copies.poll() == Completed()


def test_the_store_budget_is_a_step_of_tokens_and_stores_past_it_are_dropped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    geometry = one_group(2)
    assert step_blocks(8192, 16) == 513
    assert store_budget_bytes(geometry, 0, 8192) == 513 * geometry.rank_bytes
    mla = SlotGeometry((GroupGeometry(GroupKind.FULL, ("a",), 4096, replicated=True),), 2, 16)
    assert store_budget_bytes(mla, 0, 256) == 17 * 4096 and store_budget_bytes(mla, 1, 256) == 0, "rank 0 stores"
    shared = region(tmp_path, geometry)
    kv = kv_cache(list(geometry.layer_names), **SMALL, seed=12)
    worker = ConnectorWorker(geometry, 24, shared.path, 0)
    worker.pages = KVPages(page_views(kv, geometry), geometry, 0, shared.slots)
    worker.transfers = StagedTransfers(worker.pages, geometry, 0, shared.slots, 3 * geometry.rank_bytes)
    stores = [CopyJob(1, (0, 1), (1, 2), (0, 0)), CopyJob(2, (2, 3), (3, 4), (0, 0)), CopyJob(3, (4,), (5,), (0,))]
    with caplog.at_level(logging.WARNING):
        worker.bind(TierCacheConnectorMetadata(stores=stores))
        worker.end()
    assert caplog.text.count("past this step's staging budget") == 1
    report = worker.take_report()
    assert report is not None and dict(report.done) == {1: 1, 3: 1} and dict(report.failed) == {2: 1}
