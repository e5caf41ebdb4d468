"""The local tiers and their hierarchy, step by step: pure bookkeeping, no event loop, no waiting.

Each test drives ``MemoryTiers`` and ``Hierarchy`` the way the manager does and
reads the moves they ask for from the outbox (``support.bookkeeping_parts``), as
vLLM's offloading tests drive its manager without a worker.
"""

from __future__ import annotations

import pytest
from support.bookkeeping_parts import Parts, key, wire
from support.policy_order import policy_keys

from tiercache.bookkeeping.admission import WritePolicy
from tiercache.bookkeeping.memory_tiers import PinState, Place, Source
from tiercache.bookkeeping.moves import HostCopy, Reason, RemotePut
from tiercache.bookkeeping.slots import CapacityError

THROUGH, SELECTIVE, BACK = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK


def build(gpu_slots: int = 4, cpu_slots: int | None = 4, cpu_policy: WritePolicy = THROUGH, **options) -> Parts:
    return wire(gpu_slots, cpu_slots, cpu_policy, **options)


def store_chain(parts: Parts, keys: list[bytes]) -> list[int]:
    ids = parts.hierarchy.allocate(len(keys))
    parts.hierarchy.store(keys, ids)
    return ids


def test_a_stored_chain_is_evicted_tail_first() -> None:
    parts = build(cpu_slots=None)
    chain = [key(i) for i in range(4)]
    ids = store_chain(parts, chain)
    for block in ids:
        parts.local.gpu.unpin(block)
    parts.hierarchy.allocate(1)
    gpu = parts.local.gpu
    assert [k in gpu for k in chain] == [True, True, True, False], "the tail must go first"
    parts.hierarchy.allocate(1)
    assert [k in gpu for k in chain] == [True, True, False, False]


def test_write_through_copies_on_store_and_pins_the_gpu_blocks_until_the_copy_lands() -> None:
    parts = build(lanes=(THROUGH,))
    ids = store_chain(parts, [key(1), key(2)])
    (copy,) = parts.take()
    assert isinstance(copy, HostCopy) and copy.reason is Reason.WRITE_THROUGH and not copy.before_reuse
    assert [parts.local.gpu.ref(b) for b in ids] == [2, 2]
    parts.hierarchy.copy_done(copy, ok=True)
    assert [parts.local.gpu.ref(b) for b in ids] == [1, 1]
    (put,) = parts.take()
    assert isinstance(put, RemotePut) and put.lane == 0 and put.keys == (key(2), key(1))  # tail first
    assert all(parts.local.cpu.ref(slot) == 1 for slot in put.cpu_slots), "a put pins its slots"
    parts.remote_writes.put_done(put, [False, True])
    assert parts.remote_writes.written(0, key(1)) and not parts.remote_writes.written(0, key(2))
    assert parts.counters("remote0")["store_failures"] == 1


def test_selective_admission_holds_on_demotion_too() -> None:
    parts = build(cpu_policy=SELECTIVE)
    ids = store_chain(parts, [key(i) for i in range(4)])
    assert parts.take() == [], "never-hit blocks are not copied on store"
    for block in ids:
        parts.local.gpu.unpin(block)
    parts.hierarchy.allocate(2)
    assert parts.take() == [], "never-hit victims are not demoted"
    assert parts.counters("cpu")["not_admitted"] == 2
    parts.hierarchy.count_hits([key(0)])
    assert parts.take() == []
    parts.hierarchy.count_hits([key(0)])
    (copy,) = parts.take()
    assert copy.reason is Reason.ADMITTED and copy.keys == (key(0),)


def test_a_demotion_must_land_before_the_engine_reuses_the_block() -> None:
    parts = build(cpu_policy=BACK)
    ids = store_chain(parts, [key(i) for i in range(4)])
    assert parts.take() == []
    for block in ids:
        parts.local.gpu.unpin(block)
    fresh = parts.hierarchy.allocate(1)
    (copy,) = parts.take()
    assert copy.reason is Reason.DEMOTION and copy.before_reuse and copy.gpu_ids == tuple(fresh)
    assert parts.local.cpu.readable(key(3)) is None, "not readable before the copy lands"
    parts.hierarchy.copy_done(copy, ok=True)
    assert parts.local.cpu.readable(key(3)) is not None


def test_lookup_pins_are_taken_over_or_dropped_once() -> None:
    parts = build()
    local = parts.local
    ids = store_chain(parts, [key(1)])
    (copy,) = parts.take()
    parts.hierarchy.copy_done(copy, ok=True)
    slot = local.cpu.readable(key(1))
    pins = local.hold([ids[0]], [Place(Source.CPU, slot)])
    assert local.gpu.ref(ids[0]) == 2 and local.cpu.ref(slot) == 1
    assert local.drop(pins, with_run=True)
    assert not local.drop(pins, with_run=True), "a second release is a no-op"
    assert pins.state is PinState.RELEASED and local.gpu.ref(ids[0]) == 1 and local.cpu.ref(slot) == 0


def test_an_abandoned_write_forgets_its_key_and_keeps_its_slot_until_the_writer_lets_go() -> None:
    """A remote read past its deadline may still write into its staging slot: nothing else gets the slot."""
    parts = build(cpu_slots=2)
    cpu = parts.local.cpu
    late = parts.hierarchy.begin_remote_read(key(0))
    cpu.abandon_write(late)
    cpu.check_invariants()
    assert key(0) not in cpu and cpu.ref(late) == 1 and cpu.num_free == 1
    other = parts.hierarchy.begin_remote_read(key(1))
    assert other != late
    cpu.commit_write(other)
    assert parts.hierarchy.begin_remote_read(key(2)) == other, "room is made by evicting, never from the held slot"
    with pytest.raises(CapacityError):
        cpu.begin_write(key(3))
    cpu.unpin(late)
    cpu.check_invariants()
    assert cpu.num_free == 1 and parts.hierarchy.begin_remote_read(key(3)) == late


def test_write_through_enters_the_cpu_tier_tail_first() -> None:
    """A stored chain written through is evicted from the CPU tier tail first, as from the GPU pool."""
    parts = build(gpu_slots=8, cpu_slots=4)
    chain = [key(i) for i in range(4)]
    ids = store_chain(parts, chain)
    for move in parts.take():
        parts.hierarchy.copy_done(move, ok=True)
    parts.local.gpu.unpin(ids[0])
    store_chain(parts, [key(9)])  # one more block written through: the CPU tier evicts one
    cpu = parts.local.cpu
    assert [k in cpu for k in chain] == [True, True, True, False], "the tail must go first"


@pytest.mark.parametrize("write_policy", [THROUGH, BACK])
def test_a_demotion_is_an_access_of_the_cpu_tier_whatever_the_write_policy(write_policy: WritePolicy) -> None:
    """The block the GPU pool just evicted is the CPU tier's most recent, whether or not the CPU kept a copy.

    Under write-back the demotion inserts it; under write-through the CPU tier holds it since its
    store, and its hits on the GPU were never seen there: the demotion must count, or the CPU tier
    would rank a block it kept below one it had dropped and takes back.
    """
    parts = build(gpu_slots=3, cpu_slots=4, cpu_policy=write_policy)
    for i in range(3):
        for block in store_chain(parts, [key(i)]):
            parts.local.gpu.unpin(block)
        for move in parts.take():
            parts.hierarchy.copy_done(move, ok=True)
    parts.hierarchy.allocate(1)  # the GPU pool evicts key 0, its least recent
    for move in parts.take():
        parts.hierarchy.copy_done(move, ok=True)
    assert policy_keys(parts.local.cpu)[-1] == key(0)


@pytest.mark.parametrize("exclusive", [False, True])
def test_a_promoted_block_is_indexed_in_the_pool_and_leaves_the_cpu_tier_only_when_exclusive(exclusive: bool) -> None:
    parts = build(exclusive=exclusive)
    ids = store_chain(parts, [key(1)])
    for move in parts.take():
        parts.hierarchy.copy_done(move, ok=True)
    parts.local.gpu.unpin(ids[0])
    fresh = parts.hierarchy.allocate(4)  # the pool evicts key 1, which the CPU tier holds since its store
    assert key(1) not in parts.local.gpu and parts.local.cpu.readable(key(1)) is not None
    parts.hierarchy.promoted([(key(1), fresh[0])], copied_on_gpu=2)
    assert parts.local.gpu.key_of(fresh[0]) == key(1)
    assert (key(1) in parts.local.cpu) is not exclusive, "exclusive: the tiers add their capacities"
    assert parts.counters("cpu")["blocks_out"] == 1 and parts.counters("gpu")["blocks_in"] == 3


def test_the_engines_own_writes_are_admitted_by_the_cpu_tiers_write_policy() -> None:
    """Under ``LowerTiers`` a selective CPU tier takes the engine's block only from its threshold of hits."""
    parts = wire(None, 4, SELECTIVE)
    assert parts.hierarchy.begin_engine_writes([key(0)]) == [None]
    assert parts.counters("cpu")["not_admitted"] == 1
    parts.hierarchy.count_hits([key(0)])
    parts.hierarchy.count_hits([key(0)])
    (slot,) = parts.hierarchy.begin_engine_writes([key(0)])
    assert slot is not None and parts.local.cpu.writing(key(0))
    parts.hierarchy.end_engine_writes([key(0)], [slot], [True])
    assert parts.local.cpu.readable(key(0)) == slot and parts.counters("cpu")["blocks_in"] == 1
    assert parts.hierarchy.begin_engine_writes([key(0)]) == [None], "held already"
