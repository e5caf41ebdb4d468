"""SlotTable's allocation for a known request (``allocate_for``), step by step and under random use.

The GPU pool allocates a request's blocks before the engine computes them; with
the request's keys the policy admits them at allocation, and the slots stay
reserved for them until the engine binds or releases the slots.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.policy_order import policy_keys

from tiercache.bookkeeping.slots import CapacityError, SlotTable
from tiercache.policies import make_policy


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def cached_table(size: int, keys: list[bytes], policy: str = "lru") -> SlotTable:
    """A full table holding ``keys`` (evictable), admitted in that order."""
    table = SlotTable(size, make_policy(policy, size))
    for k in keys:
        (slot,), _ = table.allocate_for(1, [k])
        table.bind(slot, k)
        table.unpin(slot)
    return table


def test_the_policy_sees_the_request_before_it_picks_victims() -> None:
    """LRU over keys 0..3; a request for key 0 (a hit) and 9 (new): the victim is 1, the oldest after 0's hit."""
    table = cached_table(4, [key(i) for i in range(4)])
    table.touch(key(0))
    slots, victims = table.allocate_for(1, [key(0), key(9)])
    assert [v.key for v in victims] == [key(1)]
    assert key(9) in policy_keys(table) and key(9) not in table
    table.bind(slots[0], key(9))  # already admitted: binding counts nothing more
    table.unpin(slots[0])
    assert policy_keys(table) == [key(2), key(3), key(0), key(9)]
    table.check_invariants()


def test_a_reserved_key_is_never_a_victim_and_leaves_the_policy_when_its_slot_is_released() -> None:
    table = SlotTable(2, make_policy("lru", 2))
    (first,), _ = table.allocate_for(1, [key(1)])
    with pytest.raises(CapacityError):
        table.allocate(2)  # one slot free, the reserved one is not evictable
    table.unpin(first)  # the engine gave the block back unused
    assert key(1) not in policy_keys(table) and table.num_free == 2
    table.check_invariants()


def test_slots_bound_to_other_keys_than_reserved_hand_the_reservations_over() -> None:
    table = SlotTable(4, make_policy("lru", 4))
    a, b = table.allocate_for(2, [key(1), key(2)])[0]
    table.bind(a, key(2))  # key 2 was reserved on b: b now stands for key 1
    table.bind(b, key(1))
    table.check_invariants()
    (c,), _ = table.allocate_for(1, [key(3)])
    table.bind(c, key(4))  # an unexpected key: key 3 leaves the policy, key 4 is admitted
    assert key(3) not in policy_keys(table) and key(4) in policy_keys(table)
    for slot in (a, b, c):
        table.unpin(slot)
    table.check_invariants()


def test_a_reserved_key_bound_untracked_is_counted_once_by_the_holding_request() -> None:
    """A load binds a promoted block untracked; the request's store then counts nothing more for it."""
    table = cached_table(3, [key(1), key(2)])
    (slot,), _ = table.allocate_for(1, [key(5)])
    table.bind(slot, key(5), track=False)
    table.request(key(5))
    table.request(key(1))  # a hit of the same request
    table.unpin(slot)
    assert policy_keys(table) == [key(2), key(5), key(1)]
    table.check_invariants()


OPS = st.lists(
    st.tuples(st.sampled_from(["allocate_for", "bind", "bind_untracked", "request", "unpin"]), st.integers(0, 7)),
    max_size=80,
)


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "twoq"])
@settings(max_examples=150, deadline=None)
@given(ops=OPS, chains=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4), min_size=1, max_size=8))
def test_random_use_keeps_the_table_and_policy_consistent(
    policy: str, ops: list[tuple[str, int]], chains: list[list[int]]
) -> None:
    """Whatever the engine binds or releases, the policy holds exactly the bound and reserved keys."""
    table = SlotTable(6, make_policy(policy, 6))
    held: list[int] = []
    for op, n in ops:
        chain = [key(i) for i in chains[n % len(chains)]]
        if op == "allocate_for":
            with contextlib.suppress(CapacityError):
                held += table.allocate_for(n % 3 + 1, chain)[0]
        elif held and op in ("bind", "bind_untracked"):
            slot = held[n % len(held)]
            free_keys = [k for k in chain if k not in table]
            if table.key_of(slot) is None and free_keys:
                table.bind(slot, free_keys[0], track=op == "bind")
        elif held and op == "request":
            bound = table.key_of(held[n % len(held)])
            if bound is not None:
                table.request(bound)
        elif held and op == "unpin":
            table.unpin(held.pop(n % len(held)))
        table.check_invariants()
        assert len(table.policy) <= 6
    for slot in held:
        table.unpin(slot)
    table.check_invariants()
    assert len(table.policy) == table.num_cached


def test_a_noted_checksum_belongs_to_the_slot_s_bytes_until_the_slot_is_allocated_again() -> None:
    table = SlotTable(2, make_policy("lru", 2))
    first, _ = table.begin_write(key(1))
    table.note_checksum(first, 11)
    table.commit_write(first)
    assert table.checksum(first) == 11
    with pytest.raises(ValueError, match="not held"):
        table.note_checksum(first, 12)  # cached, not being written: its bytes are settled
    (second,), _ = table.allocate_for(1, [key(2)])
    table.note_checksum(second, 22)
    table.bind(second, key(2))
    table.unpin(second)
    assert (table.checksum(first), table.checksum(second)) == (11, 22)
    (reused,), victims = table.allocate(1)  # evicts key 1 (LRU) and hands its slot out again
    assert victims[0].key == key(1) and reused == first
    assert table.checksum(reused) is None and table.checksum(second) == 22
    (reserved,), victims = table.allocate_for(1, [key(3)])  # evicts key 2 through a reservation
    assert victims[0].key == key(2) and reserved == second
    assert table.checksum(reserved) is None
