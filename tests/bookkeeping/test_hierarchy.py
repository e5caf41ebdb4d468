"""The local tiers and the hierarchy, step by step: pure bookkeeping, no event loop, no waiting.

Each test drives ``MemoryTiers`` and ``Hierarchy`` the way the manager does and
reads the moves they ask for from the outbox, as vLLM's offloading tests drive
its manager without a worker.
"""

from __future__ import annotations

import pytest

from tiercache.bookkeeping.admission import FillRule, WritePolicy
from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.memory_tiers import MemoryTiers, PinState, Place, Source
from tiercache.bookkeeping.moves import HostCopy, Reason, RemotePut
from tiercache.bookkeeping.slots import CapacityError, SlotTable
from tiercache.policies import make_policy
from tiercache.telemetry.counters import Metrics

THROUGH, SELECTIVE, BACK = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def build(
    gpu_slots: int = 4,
    cpu_slots: int | None = 4,
    cpu_policy: WritePolicy = THROUGH,
    lanes: tuple[WritePolicy, ...] = (),
    max_pending_stores: int = 64,
    remember_keys: int = 1000,
) -> Hierarchy:
    gpu = SlotTable(gpu_slots, make_policy("lru", gpu_slots))
    cpu = SlotTable(cpu_slots, make_policy("lru", cpu_slots)) if cpu_slots else None
    rules = [FillRule(f"remote{i}", policy, 2) for i, policy in enumerate(lanes)]
    return Hierarchy(
        MemoryTiers(gpu, cpu),
        FillRule("cpu", cpu_policy, 2) if cpu else None,
        rules,
        Metrics(),
        gpu_name="gpu",
        block_size=2,
        bytes_per_block=64,
        max_pending_stores=max_pending_stores,
        remember_keys=remember_keys,
    )


def counters(hierarchy: Hierarchy, tier: str) -> dict[str, int]:
    return dict(hierarchy.metrics.counters.get(tier, {}))


def take(hierarchy: Hierarchy) -> list:
    moves, hierarchy.outbox = hierarchy.outbox, []
    return moves


def store_chain(hierarchy: Hierarchy, keys: list[bytes]) -> list[int]:
    ids = hierarchy.allocate(len(keys))
    hierarchy.store(keys, ids)
    return ids


def test_a_stored_chain_is_evicted_tail_first() -> None:
    hierarchy = build(cpu_slots=None)
    chain = [key(i) for i in range(4)]
    ids = store_chain(hierarchy, chain)
    for block in ids:
        hierarchy.local.gpu.unpin(block)
    hierarchy.allocate(1)
    gpu = hierarchy.local.gpu
    assert [k in gpu for k in chain] == [True, True, True, False], "the tail must go first"
    hierarchy.allocate(1)
    assert [k in gpu for k in chain] == [True, True, False, False]


def test_write_through_copies_on_store_and_pins_the_gpu_blocks_until_the_copy_lands() -> None:
    hierarchy = build(lanes=(THROUGH,))
    ids = store_chain(hierarchy, [key(1), key(2)])
    (copy,) = take(hierarchy)
    assert isinstance(copy, HostCopy) and copy.reason is Reason.WRITE_THROUGH and not copy.before_reuse
    assert [hierarchy.local.gpu.ref(b) for b in ids] == [2, 2]
    hierarchy.copy_done(copy, ok=True)
    assert [hierarchy.local.gpu.ref(b) for b in ids] == [1, 1]
    (put,) = take(hierarchy)
    assert isinstance(put, RemotePut) and put.lane == 0 and put.keys == (key(2), key(1))  # tail first
    assert all(hierarchy.local.cpu.ref(slot) == 1 for slot in put.cpu_slots), "a put pins its slots"
    hierarchy.put_done(put, [False, True])
    assert hierarchy.written(0, key(1)) and not hierarchy.written(0, key(2))
    assert counters(hierarchy, "remote0")["store_failures"] == 1


def test_selective_admission_holds_on_demotion_too() -> None:
    hierarchy = build(cpu_policy=SELECTIVE)
    ids = store_chain(hierarchy, [key(i) for i in range(4)])
    assert take(hierarchy) == [], "never-hit blocks are not copied on store"
    for block in ids:
        hierarchy.local.gpu.unpin(block)
    hierarchy.allocate(2)
    assert take(hierarchy) == [], "never-hit victims are not demoted"
    assert counters(hierarchy, "cpu")["not_admitted"] == 2
    hierarchy.count_hits([key(0)])
    assert take(hierarchy) == []
    hierarchy.count_hits([key(0)])
    (copy,) = take(hierarchy)
    assert copy.reason is Reason.ADMITTED and copy.keys == (key(0),)


def test_a_demotion_must_land_before_the_engine_reuses_the_block() -> None:
    hierarchy = build(cpu_policy=BACK)
    ids = store_chain(hierarchy, [key(i) for i in range(4)])
    assert take(hierarchy) == []
    for block in ids:
        hierarchy.local.gpu.unpin(block)
    fresh = hierarchy.allocate(1)
    (copy,) = take(hierarchy)
    assert copy.reason is Reason.DEMOTION and copy.before_reuse and copy.gpu_ids == tuple(fresh)
    assert hierarchy.local.cpu.readable(key(3)) is None, "not readable before the copy lands"
    hierarchy.copy_done(copy, ok=True)
    assert hierarchy.local.cpu.readable(key(3)) is not None


def test_a_write_back_victim_keeps_its_slot_until_its_put_lands() -> None:
    hierarchy = build(cpu_slots=2, lanes=(BACK,))
    cpu = hierarchy.local.cpu
    slots = [hierarchy.begin_cpu_write(key(i)) for i in range(2)]
    for slot in slots:
        cpu.commit_write(slot)
    hierarchy.fetched(0, [key(1)], [slots[1]])
    assert hierarchy.begin_cpu_write(key(2)) == slots[1], "the clean victim's slot is reused"
    (put,) = take(hierarchy)
    assert put.reason is Reason.DEMOTION and put.keys == (key(0),) and put.cpu_slots == (slots[0],)
    assert key(0) not in cpu and cpu.ref(slots[0]) == 1, "the victim's bytes stay where the put reads them"
    assert cpu.num_free == 0 and hierarchy.pending_stores == 1
    with pytest.raises(CapacityError):
        cpu.begin_write(key(9))
    hierarchy.put_done(put, [True])
    assert cpu.num_free == 1 and hierarchy.written(0, key(0))


def test_when_only_dirty_victims_remain_the_write_waits_for_their_puts() -> None:
    hierarchy = build(cpu_slots=2, lanes=(BACK,))
    cpu = hierarchy.local.cpu
    for i in range(2):
        cpu.commit_write(hierarchy.begin_cpu_write(key(i)))
    assert hierarchy.begin_cpu_write(key(2)) is None, "no clean slot now"
    puts = take(hierarchy)
    assert [put.keys for put in puts] == [(key(0),), (key(1),)]
    assert cpu.num_free == 0 and cpu.num_cached == 0 and key(2) not in cpu
    for put in puts:
        hierarchy.put_done(put, [True])
    assert cpu.num_free == 2
    assert hierarchy.begin_cpu_write(key(2)) is not None


def test_a_write_back_is_dropped_not_copied_aside_when_the_store_queue_is_full() -> None:
    hierarchy = build(cpu_slots=2, lanes=(BACK,), max_pending_stores=0)
    cpu = hierarchy.local.cpu
    for i in range(2):
        cpu.commit_write(hierarchy.begin_cpu_write(key(i)))
    assert hierarchy.begin_cpu_write(key(2)) is not None
    assert take(hierarchy) == []
    assert counters(hierarchy, "remote0")["stores_dropped"] == 1
    assert cpu.num_free == 0 and cpu.num_cached == 2


def test_a_failed_read_forgets_the_key_so_the_next_copy_rewrites_it() -> None:
    hierarchy = build(lanes=(THROUGH,))
    store_chain(hierarchy, [key(1)])
    (copy,) = take(hierarchy)
    hierarchy.copy_done(copy, ok=True)
    (put,) = take(hierarchy)
    hierarchy.put_done(put, [True])
    assert hierarchy.written(0, key(1))
    hierarchy.forget(0, [key(1)])
    assert not hierarchy.written(0, key(1))


def test_a_block_read_from_a_slower_remote_is_written_into_the_faster_ones() -> None:
    hierarchy = build(lanes=(THROUGH, BACK, THROUGH))
    cpu = hierarchy.local.cpu
    slot = hierarchy.begin_cpu_write(key(5))
    cpu.commit_write(slot)
    hierarchy.fetched(2, [key(5)], [slot])
    (put,) = take(hierarchy)
    assert put.lane == 0 and put.reason is Reason.PROMOTION, "write_back lane 1 waits for an eviction"
    assert hierarchy.written(2, key(5))


def test_the_keys_remembered_as_in_a_remote_stay_bounded_when_reads_serve_them() -> None:
    hierarchy = build(cpu_slots=16, lanes=(THROUGH,), remember_keys=4)
    cpu = hierarchy.local.cpu
    keys = [key(i) for i in range(10)]
    slots = []
    for k in keys:
        slots.append(hierarchy.begin_cpu_write(k))
        cpu.commit_write(slots[-1])
    hierarchy.fetched(0, keys, slots)
    remembered = [k for k in keys if hierarchy.written(0, k)]
    assert remembered == keys[-4:], "the most recently served keys are kept, within remember_keys"


def test_lookup_pins_are_taken_over_or_dropped_once() -> None:
    hierarchy = build()
    local = hierarchy.local
    ids = store_chain(hierarchy, [key(1)])
    (copy,) = take(hierarchy)
    hierarchy.copy_done(copy, ok=True)
    slot = local.cpu.readable(key(1))
    pins = local.hold([ids[0]], [Place(Source.CPU, slot)])
    assert local.gpu.ref(ids[0]) == 2 and local.cpu.ref(slot) == 1
    assert local.drop(pins, with_run=True)
    assert not local.drop(pins, with_run=True), "a second release is a no-op"
    assert pins.state is PinState.RELEASED and local.gpu.ref(ids[0]) == 1 and local.cpu.ref(slot) == 0


def test_an_abandoned_write_forgets_its_key_and_keeps_its_slot_until_the_writer_lets_go() -> None:
    """A remote read past its deadline may still write into its staging slot: nothing else gets the slot."""
    hierarchy = build(cpu_slots=2)
    cpu = hierarchy.local.cpu
    late = hierarchy.begin_cpu_write(key(0))
    cpu.abandon_write(late)
    cpu.check_invariants()
    assert key(0) not in cpu and cpu.ref(late) == 1 and cpu.num_free == 1
    other = hierarchy.begin_cpu_write(key(1))
    assert other != late
    cpu.commit_write(other)
    assert hierarchy.begin_cpu_write(key(2)) == other, "room is made by evicting, never from the held slot"
    with pytest.raises(CapacityError):
        cpu.begin_write(key(3))
    cpu.unpin(late)
    cpu.check_invariants()
    assert cpu.num_free == 1 and hierarchy.begin_cpu_write(key(3)) == late


def test_write_through_enters_the_cpu_tier_tail_first() -> None:
    """A stored chain written through is evicted from the CPU tier tail first, as from the GPU pool."""
    hierarchy = build(gpu_slots=8, cpu_slots=4)
    chain = [key(i) for i in range(4)]
    ids = store_chain(hierarchy, chain)
    for move in take(hierarchy):
        hierarchy.copy_done(move, ok=True)
    hierarchy.local.gpu.unpin(ids[0])
    store_chain(hierarchy, [key(9)])  # one more block written through: the CPU tier evicts one
    cpu = hierarchy.local.cpu
    assert [k in cpu for k in chain] == [True, True, True, False], "the tail must go first"


@pytest.mark.parametrize("write_policy", [THROUGH, BACK])
def test_a_demotion_is_an_access_of_the_cpu_tier_whatever_the_write_policy(write_policy: WritePolicy) -> None:
    """The block the GPU pool just evicted is the CPU tier's most recent, whether or not the CPU kept a copy.

    Under write-back the demotion inserts it; under write-through the CPU tier holds it since its
    store, and its hits on the GPU were never seen there: the demotion must count, or the CPU tier
    would rank a block it kept below one it had dropped and takes back.
    """
    hierarchy = build(gpu_slots=3, cpu_slots=4, cpu_policy=write_policy)
    for i in range(3):
        for block in store_chain(hierarchy, [key(i)]):
            hierarchy.local.gpu.unpin(block)
        for move in take(hierarchy):
            hierarchy.copy_done(move, ok=True)
    hierarchy.allocate(1)  # the GPU pool evicts key 0, its least recent
    for move in take(hierarchy):
        hierarchy.copy_done(move, ok=True)
    assert list(hierarchy.local.cpu.policy)[-1] == key(0)
