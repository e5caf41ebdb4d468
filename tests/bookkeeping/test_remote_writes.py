"""The remote lanes' writes, step by step: pure bookkeeping, no event loop, no waiting.

Each test drives ``Hierarchy`` and ``RemoteWrites`` the way the manager does (CPU writes that land or make
room, puts that land, reads that served or missed) and reads the puts they ask for from the outbox
(``support.bookkeeping_parts``).
"""

from __future__ import annotations

import pytest
from support.bookkeeping_parts import Parts, Removals, key, wire

from tiercache.bookkeeping.admission import WritePolicy
from tiercache.bookkeeping.moves import Reason, RemotePut
from tiercache.bookkeeping.slots import CapacityError

THROUGH, SELECTIVE, BACK = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK


def build(cpu_slots: int = 4, **options) -> Parts:
    """A CPU tier under an engine's own pool (the remotes' puts read its slots), over the lanes in ``options``."""
    return wire(None, cpu_slots, **options)


def landed(parts: Parts, keys: list[bytes], checksums: list[int] | None = None) -> list[int]:
    """``keys`` written into CPU slots by the engine (with their ``checksums`` noted), and every put that asked
    for landed."""
    slots = parts.hierarchy.begin_engine_writes(keys)
    for slot, checksum in zip(slots, checksums or [], strict=False):
        parts.local.cpu.note_checksum(slot, checksum)
    parts.hierarchy.end_engine_writes(keys, slots, [True] * len(keys))
    for put in parts.take():
        parts.remote_writes.put_done(put, [True] * len(put.keys))
    return slots


def test_a_write_back_victim_keeps_its_slot_until_its_put_lands() -> None:
    parts = build(cpu_slots=2, lanes=(BACK,))
    cpu = parts.local.cpu
    slots = [parts.hierarchy.begin_remote_read(key(i)) for i in range(2)]
    for slot in slots:
        cpu.commit_write(slot)
    parts.remote_writes.fetched(0, [key(1)], [slots[1]])
    assert parts.hierarchy.begin_remote_read(key(2)) == slots[1], "the clean victim's slot is reused"
    (put,) = parts.take()
    assert put.reason is Reason.DEMOTION and put.keys == (key(0),) and put.cpu_slots == (slots[0],)
    assert key(0) not in cpu and cpu.ref(slots[0]) == 1, "the victim's bytes stay where the put reads them"
    assert cpu.num_free == 0 and parts.remote_writes.pending_stores == 1
    with pytest.raises(CapacityError):
        cpu.begin_write(key(9))
    parts.remote_writes.put_done(put, [True])
    assert cpu.num_free == 1 and parts.remote_writes.written(0, key(0))


def test_when_only_dirty_victims_remain_the_write_waits_for_their_puts() -> None:
    parts = build(cpu_slots=2, lanes=(BACK,))
    cpu = parts.local.cpu
    for i in range(2):
        cpu.commit_write(parts.hierarchy.begin_remote_read(key(i)))
    assert parts.hierarchy.begin_remote_read(key(2)) is None, "no clean slot now"
    puts = parts.take()
    assert [put.keys for put in puts] == [(key(0),), (key(1),)]
    assert cpu.num_free == 0 and cpu.num_cached == 0 and key(2) not in cpu
    for put in puts:
        parts.remote_writes.put_done(put, [True])
    assert cpu.num_free == 2
    assert parts.hierarchy.begin_remote_read(key(2)) is not None


def test_a_write_back_is_dropped_not_copied_aside_when_the_store_queue_is_full() -> None:
    parts = build(cpu_slots=2, lanes=(BACK,), max_pending_stores=0)
    cpu = parts.local.cpu
    for i in range(2):
        cpu.commit_write(parts.hierarchy.begin_remote_read(key(i)))
    assert parts.hierarchy.begin_remote_read(key(2)) is not None
    assert parts.take() == []
    assert parts.counters("remote0")["stores_dropped"] == 1
    assert cpu.num_free == 0 and cpu.num_cached == 2


def test_a_failed_read_forgets_the_key_so_the_next_store_rewrites_it_and_tells_no_router() -> None:
    removals = Removals()
    parts = build(lanes=(THROUGH,), observer=removals)
    landed(parts, [key(1), key(2)])
    assert parts.remote_writes.written(0, key(1)) and parts.remote_writes.written(0, key(2))
    parts.remote_writes.read_tried(0, [key(1), key(2)], missed=[key(1)])
    assert not parts.remote_writes.written(0, key(1)) and parts.remote_writes.written(0, key(2))
    assert removals.seen == [], "a failed read proves nothing: routers keep the block"
    parts.remote_writes.forget(0, [key(2)])  # the remote said so
    assert removals.seen == [("remote0", [key(2)])]


def test_a_block_read_from_a_slower_remote_is_written_into_the_faster_ones() -> None:
    parts = build(lanes=(THROUGH, BACK, THROUGH))
    cpu = parts.local.cpu
    slot = parts.hierarchy.begin_remote_read(key(5))
    cpu.commit_write(slot)
    parts.remote_writes.fetched(2, [key(5)], [slot])
    (put,) = parts.take()
    assert put.lane == 0 and put.reason is Reason.PROMOTION, "write_back lane 1 waits for an eviction"
    assert parts.remote_writes.written(2, key(5))


def test_the_keys_remembered_as_in_a_remote_stay_bounded_when_reads_serve_them() -> None:
    parts = build(cpu_slots=16, lanes=(THROUGH,), remember_keys=4)
    cpu = parts.local.cpu
    keys = [key(i) for i in range(10)]
    slots = []
    for k in keys:
        slots.append(parts.hierarchy.begin_remote_read(k))
        cpu.commit_write(slots[-1])
    parts.remote_writes.fetched(0, keys, slots)
    remembered = [k for k in keys if parts.remote_writes.written(0, k)]
    assert remembered == keys[-4:], "the most recently served keys are kept, within remember_keys"


def test_a_put_carries_the_checksums_noted_when_its_bytes_landed() -> None:
    """A remote's write path sends the bytes without reading them: the checksum rides on the move."""
    parts = build(cpu_slots=2, lanes=(THROUGH, BACK))
    slots = parts.hierarchy.begin_engine_writes([key(0), key(1)])
    parts.local.cpu.note_checksum(slots[0], 1234)
    parts.hierarchy.end_engine_writes([key(0), key(1)], slots, [True, True])
    (through,) = parts.take()
    assert through.checksums == (1234, None), "a slot without a noted checksum carries None"
    parts.remote_writes.put_done(through, [True, True])
    parts.hierarchy.begin_engine_writes([key(2)])  # evicts both: write_back lane 1 still needs them
    assert [(put.lane, put.keys, put.checksums) for put in parts.take()] == [
        (1, (key(0),), (1234,)), (1, (key(1),), (None,))
    ]


def test_a_key_the_remote_drops_while_its_put_is_in_flight_is_forgotten_once_the_put_lands() -> None:
    removals = Removals()
    parts = build(lanes=(THROUGH,), observer=removals)
    slots = parts.hierarchy.begin_engine_writes([key(0)])
    parts.hierarchy.end_engine_writes([key(0)], slots, [True])
    (put,) = parts.take()
    parts.remote_writes.evicted(0, [key(0)])  # the remote reports dropping it before the put's answer arrives
    assert removals.seen == []
    parts.remote_writes.put_done(put, [True])
    assert not parts.remote_writes.written(0, key(0)), "the landing would otherwise remember a dropped key"
    assert removals.seen == [("remote0", [key(0)])]


def test_a_not_held_answer_is_stale_for_a_key_stored_since_it_was_given() -> None:
    parts = build(lanes=(THROUGH,))
    landed(parts, [key(0)])
    clock = parts.remote_writes.written_clock()
    landed(parts, [key(1)])
    parts.remote_writes.forget_absent(0, [key(0), key(1)], clock)  # answered "not held" for both, before key 1 landed
    assert [parts.remote_writes.written(0, k) for k in (key(0), key(1))] == [False, True]


def test_a_selective_lane_is_written_at_the_hit_that_reaches_its_threshold() -> None:
    parts = build(lanes=(SELECTIVE,))
    landed(parts, [key(0)])
    assert parts.take() == [], "never hit: not admitted"
    parts.hierarchy.count_hits([key(0)])
    assert parts.take() == []
    parts.hierarchy.count_hits([key(0)])
    (put,) = parts.take()
    assert isinstance(put, RemotePut) and put.reason is Reason.ADMITTED and put.keys == (key(0),)
