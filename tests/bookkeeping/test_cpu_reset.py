"""The CPU tier's reset step by step: pure bookkeeping under an engine's own pool, no event loop, no waiting.

Each test drives ``Hierarchy`` and ``RemoteWrites`` as ``LowerTiers`` does (the engine's writes into CPU slots,
the puts to the remotes from the outbox, their landings) and resets the tier between steps.
"""

from __future__ import annotations

from support.bookkeeping_parts import Parts, Removals, key, wire

from tiercache.bookkeeping.admission import WritePolicy
from tiercache.bookkeeping.memory_tiers import Place, Source
from tiercache.bookkeeping.moves import Reason, RemotePut
from tiercache.bookkeeping.slots import SlotTable

THROUGH, SELECTIVE, BACK = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK


def build(cpu_slots: int, lane: WritePolicy) -> tuple[Parts, SlotTable, Removals]:
    """A CPU tier under an engine's own pool (no GPU table), over one remote lane filled by ``lane``."""
    removals = Removals()
    parts = wire(None, cpu_slots, THROUGH, (lane,), observer=removals)
    assert parts.local.cpu is not None
    return parts, parts.local.cpu, removals


def engine_write(parts: Parts, keys: list[bytes]) -> list[int]:
    """The engine's store: CPU slots begun for ``keys`` and its copies into them landed."""
    slots = parts.hierarchy.begin_engine_writes(keys)
    assert None not in slots
    parts.hierarchy.end_engine_writes(keys, slots, [True] * len(keys))  # type: ignore[arg-type]
    return slots  # type: ignore[return-value]


def puts(parts: Parts) -> list[RemotePut]:
    moves = parts.take()
    assert all(isinstance(move, RemotePut) for move in moves)
    return moves  # type: ignore[return-value]


def test_reset_drops_what_nothing_holds_and_keeps_pins_writes_and_puts_in_flight() -> None:
    parts, cpu, removals = build(6, THROUGH)
    keys = [key(i) for i in range(6)]
    slots = engine_write(parts, keys[:5])
    (put,) = puts(parts)
    assert parts.hierarchy.reset_cpu_tier() == [], "a put to the remote in flight pins every slot it reads"

    parts.remote_writes.put_done(put, [True] * 4 + [False])  # the fifth block's put failed: the remote still needs it
    writing = parts.hierarchy.begin_engine_writes([keys[5]])[0]
    assert writing is not None
    parts.local.pin(Place(Source.CPU, slots[0]))  # a lookup's (or a fetch's) pin
    assert parts.hierarchy.reset_cpu_tier() == keys[1:4]
    assert removals.seen == [("cpu", keys[1:4])], "reported as an eviction is"
    assert parts.metrics.counters["cpu"]["evictions"] == 3
    assert [cpu.readable(k) for k in (keys[0], keys[4])] == [slots[0], slots[4]], "held entries keep their slots"
    assert cpu.writing(keys[5])
    assert not any(k in cpu for k in keys[1:4])
    assert cpu.num_free == 3
    cpu.check_invariants()

    parts.hierarchy.end_engine_writes([keys[5]], [writing], [True])  # the engine's copy lands after the reset
    assert cpu.readable(keys[5]) == writing
    (put,) = puts(parts)
    parts.remote_writes.put_done(put, [True])
    parts.local.unpin(Place(Source.CPU, slots[0]))
    assert parts.hierarchy.reset_cpu_tier() == [keys[0], keys[5]]
    assert parts.hierarchy.reset_cpu_tier() == [], "a reset of a reset tier drops nothing"
    assert [k in cpu for k in keys] == [False] * 4 + [True, False]
    assert parts.remote_writes.written(0, keys[0]), "what the remote was told to hold is left as it is"
    cpu.check_invariants()

    fresh = engine_write(parts, [key(10 + i) for i in range(5)])
    assert sorted(fresh) == sorted(set(range(6)) - {slots[4]}), "every freed slot is written again"
    cpu.check_invariants()


def test_a_block_a_write_back_remote_still_needs_stays_until_its_eviction_writes_it_down() -> None:
    parts, cpu, removals = build(2, BACK)
    keys = [key(i) for i in range(3)]
    engine_write(parts, keys[:2])
    assert puts(parts) == [], "a write-back remote is filled on eviction only"
    assert parts.hierarchy.reset_cpu_tier() == [], "dropping them would need write-backs a full queue could drop"
    assert removals.seen == []

    assert parts.hierarchy.begin_engine_writes([keys[2]])[0] is None, "pressure: both go, kept for their write-backs"
    written_back = puts(parts)
    assert [(put.keys, put.reason) for put in written_back] == [((k,), Reason.DEMOTION) for k in keys[:2]]
    for put in written_back:
        parts.remote_writes.put_done(put, [True])
    assert removals.seen == [("cpu", keys[:2])], "the eviction reports them removed"
    engine_write(parts, keys[2:])
    assert parts.hierarchy.reset_cpu_tier() == [], "the new block is still owed to the remote"
    assert [k in cpu for k in keys] == [False, False, True]
    assert all(parts.remote_writes.written(0, k) for k in keys[:2])
    cpu.check_invariants()


def test_a_block_a_selective_remote_has_not_admitted_yet_is_dropped() -> None:
    parts, cpu, _ = build(2, SELECTIVE)
    keys = [key(0), key(1)]
    engine_write(parts, keys)
    assert puts(parts) == [], "never hit: not admitted by the remote"
    assert parts.hierarchy.reset_cpu_tier() == keys
    assert cpu.num_free == 2
    cpu.check_invariants()
