"""The CPU tier's reset step by step: pure bookkeeping under an engine's own pool, no event loop, no waiting.

Each test drives ``Hierarchy`` as ``LowerTiers`` does (the engine's writes into CPU slots,
the puts to the remotes from the outbox, their landings) and resets the tier between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.bookkeeping.admission import FillRule, WritePolicy
from tiercache.bookkeeping.cpu_reset import reset_cpu_tier
from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.memory_tiers import MemoryTiers, Place, Source
from tiercache.bookkeeping.moves import Reason, RemotePut
from tiercache.bookkeeping.slots import SlotTable
from tiercache.policies import make_policy
from tiercache.telemetry.counters import Metrics

THROUGH, SELECTIVE, BACK = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK


class Removals:
    """An observer that keeps every removal it is told of."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[bytes]]] = []

    def stored(self, tier: str, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None) -> None:
        return None

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        self.seen.append((tier, list(keys)))

    def accessed(self, tier: str, keys: Sequence[bytes]) -> None:
        return None


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def build(cpu_slots: int, lane: WritePolicy) -> tuple[Hierarchy, SlotTable, Removals]:
    """A CPU tier under an engine's own pool (no GPU table), over one remote lane filled by ``lane``."""
    cpu = SlotTable(cpu_slots, make_policy("lru", cpu_slots))
    removals = Removals()
    hierarchy = Hierarchy(
        MemoryTiers(None, cpu), FillRule("cpu", THROUGH, 2), [FillRule("remote", lane, 2)], Metrics(),
        gpu_name="engine", block_size=2, bytes_per_block=64, max_pending_stores=64, remember_keys=1000,
        observer=removals,
    )
    return hierarchy, cpu, removals


def engine_write(hierarchy: Hierarchy, keys: list[bytes]) -> list[int]:
    """The engine's store: CPU slots begun for ``keys`` and its copies into them landed."""
    slots = [hierarchy.begin_engine_write(k) for k in keys]
    assert None not in slots
    hierarchy.written_down(keys, slots, [True] * len(keys))  # type: ignore[arg-type]
    return slots  # type: ignore[return-value]


def puts(hierarchy: Hierarchy) -> list[RemotePut]:
    moves, hierarchy.outbox = hierarchy.outbox, []
    assert all(isinstance(move, RemotePut) for move in moves)
    return moves  # type: ignore[return-value]


def test_reset_drops_what_nothing_holds_and_keeps_pins_writes_and_puts_in_flight() -> None:
    hierarchy, cpu, removals = build(6, THROUGH)
    keys = [key(i) for i in range(6)]
    slots = engine_write(hierarchy, keys[:5])
    (put,) = puts(hierarchy)
    assert reset_cpu_tier(hierarchy) == [], "a put to the remote in flight pins every slot it reads"

    hierarchy.put_done(put, [True] * 4 + [False])  # the fifth block's put failed: the remote still needs it
    writing = hierarchy.begin_engine_write(keys[5])
    assert writing is not None
    hierarchy.local.pin(Place(Source.CPU, slots[0]))  # a lookup's (or a fetch's) pin
    assert reset_cpu_tier(hierarchy) == keys[1:4]
    assert removals.seen == [("cpu", keys[1:4])], "reported as an eviction is"
    assert hierarchy.metrics.counters["cpu"]["evictions"] == 3
    assert [cpu.readable(k) for k in (keys[0], keys[4])] == [slots[0], slots[4]], "held entries keep their slots"
    assert cpu.writing(keys[5])
    assert not any(k in cpu for k in keys[1:4])
    assert cpu.num_free == 3
    cpu.check_invariants()

    hierarchy.written_down([keys[5]], [writing], [True])  # the engine's copy lands after the reset
    assert cpu.readable(keys[5]) == writing
    (put,) = puts(hierarchy)
    hierarchy.put_done(put, [True])
    hierarchy.local.unpin(Place(Source.CPU, slots[0]))
    assert reset_cpu_tier(hierarchy) == [keys[0], keys[5]]
    assert reset_cpu_tier(hierarchy) == [], "a reset of a reset tier drops nothing"
    assert [k in cpu for k in keys] == [False] * 4 + [True, False]
    assert hierarchy.written(0, keys[0]), "what the remote was told to hold is left as it is"
    cpu.check_invariants()

    fresh = engine_write(hierarchy, [key(10 + i) for i in range(5)])
    assert sorted(fresh) == sorted(set(range(6)) - {slots[4]}), "every freed slot is written again"
    cpu.check_invariants()


def test_a_block_a_write_back_remote_still_needs_stays_until_its_eviction_writes_it_down() -> None:
    hierarchy, cpu, removals = build(2, BACK)
    keys = [key(i) for i in range(3)]
    engine_write(hierarchy, keys[:2])
    assert puts(hierarchy) == [], "a write-back remote is filled on eviction only"
    assert reset_cpu_tier(hierarchy) == [], "dropping them would need write-backs a full queue could drop"
    assert removals.seen == []

    assert hierarchy.begin_engine_write(keys[2]) is None, "pressure: both go, kept for their write-backs"
    written_back = puts(hierarchy)
    assert [(put.keys, put.reason) for put in written_back] == [((k,), Reason.DEMOTION) for k in keys[:2]]
    for put in written_back:
        hierarchy.put_done(put, [True])
    assert removals.seen == [("cpu", keys[:2])], "the eviction reports them removed"
    engine_write(hierarchy, keys[2:])
    assert reset_cpu_tier(hierarchy) == [], "the new block is still owed to the remote"
    assert [k in cpu for k in keys] == [False, False, True]
    assert all(hierarchy.written(0, k) for k in keys[:2])
    cpu.check_invariants()


def test_a_block_a_selective_remote_has_not_admitted_yet_is_dropped() -> None:
    hierarchy, cpu, _ = build(2, SELECTIVE)
    keys = [key(0), key(1)]
    engine_write(hierarchy, keys)
    assert puts(hierarchy) == [], "never hit: not admitted by the remote"
    assert reset_cpu_tier(hierarchy) == keys
    assert cpu.num_free == 2
    cpu.check_invariants()
