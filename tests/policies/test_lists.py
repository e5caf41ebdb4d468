"""The policies' flat structures, step by step against plain Python models.

``EntryLists`` (linked lists in arrays) against a list of lists, both directions of every link checked after each
operation; ``Ghosts`` (fingerprints in an open-addressing table) against a dict of deques, with a tiny table and
fingerprints chosen to collide in it so probe runs, wrap-around and backward-shift deletion are exercised.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.policies.ghosts import Ghosts
from tiercache.policies.lists import NOT_LISTED, EntryLists

SIZE = 12
LISTS = 3

operations = st.lists(
    st.tuples(st.sampled_from(["append", "unlink", "move", "exchange", "pop", "grow"]),
              st.integers(0, 4 * SIZE), st.integers(0, 4 * SIZE), st.integers(0, LISTS - 1)),
    max_size=80,
)


def assert_same(lists: EntryLists, model: list[list[int]]) -> None:
    """Every list's order forwards, backwards (through the prev links), its length and each entry's list."""
    for number, expected in enumerate(model):
        assert list(lists.entries(number)) == expected
        assert lists.lengths[number] == len(expected)
        assert lists.oldest(number) == (expected[0] if expected else -1)
        backwards, entry = [], lists._prev[lists.size + number]
        while entry != lists.size + number:
            backwards.append(entry)
            entry = lists._prev[entry]
        assert backwards == expected[::-1]
    where = {entry: number for number, entries in enumerate(model) for entry in entries}
    assert [lists.list_of(entry) for entry in range(lists.size)] == [
        where.get(entry, NOT_LISTED) for entry in range(lists.size)
    ]


@settings(max_examples=300, deadline=None)
@given(operations)
def test_entry_lists_match_a_list_model(steps: list[tuple[str, int, int, int]]) -> None:
    lists, model, size = EntryLists(SIZE, LISTS), [[] for _ in range(LISTS)], SIZE
    for operation, a, b, number in steps:
        first, second = a % size, b % size
        listed = {entry: n for n, entries in enumerate(model) for entry in entries}
        if operation == "append" and first not in listed:
            lists.append(number, first)
            model[number].append(first)
        elif operation == "unlink":
            assert lists.unlink(first) == listed.get(first, NOT_LISTED)
            if first in listed:
                model[listed[first]].remove(first)
        elif operation == "move" and first in listed:
            lists.move_to_end(first, number)
            model[listed[first]].remove(first)
            model[number].append(first)
        elif operation == "exchange":
            lists.exchange(first, second)
            renamed = {first: second, second: first}
            model = [[renamed.get(entry, entry) for entry in entries] for entries in model]
        elif operation == "pop" and model[number]:
            assert lists.pop_oldest(number) == model[number].pop(0)
        elif operation == "grow":
            size += a % 5
            lists.grow(size)
        assert_same(lists, model)


def test_exchange_of_neighbours_in_both_orders() -> None:
    lists = EntryLists(4, 1)
    for entry in (0, 1, 2, 3):
        lists.append(0, entry)
    lists.exchange(1, 2)
    assert list(lists.entries(0)) == [0, 2, 1, 3]
    lists.exchange(1, 2)
    assert list(lists.entries(0)) == [0, 1, 2, 3]
    lists.exchange(3, 0)
    assert_same(lists, [[3, 1, 2, 0]])


def test_entry_lists_refuse_an_impossible_list_count() -> None:
    with pytest.raises(ValueError, match="lists must be in"):
        EntryLists(4, 0)


ghost_steps = st.lists(
    st.tuples(st.sampled_from(["append", "take", "pop"]), st.integers(0, 31), st.integers(0, 1)),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ghost_steps, st.sampled_from([1, 2**58, -(2**40)]))
def test_ghosts_match_a_deque_model(steps: list[tuple[str, int, int]], spread: int) -> None:
    """Fingerprints ``k * 2**58`` have 64 distinct top bits at most: they collide in the table, its probe runs long."""
    ghosts, model = Ghosts(2), [deque(), deque()]
    for operation, key, number in steps:
        fingerprint = key * spread
        where = next((n for n, fingerprints in enumerate(model) if fingerprint in fingerprints), NOT_LISTED)
        if operation == "append" and where == NOT_LISTED:
            ghosts.append(number, fingerprint)
            model[number].append(fingerprint)
        elif operation == "take":
            assert ghosts.take(fingerprint) == where
            if where != NOT_LISTED:
                model[where].remove(fingerprint)
        elif operation == "pop" and model[number]:
            ghosts.pop_oldest(number)
            model[number].popleft()
        assert [ghosts.lengths[n] for n in (0, 1)] == [len(fingerprints) for fingerprints in model]
        assert len(ghosts) == sum(map(len, model))
    for number, fingerprints in enumerate(model):  # every remembered fingerprint is still found, in its list
        for fingerprint in list(fingerprints):
            assert ghosts.take(fingerprint) == number
    assert len(ghosts) == 0


def test_ghosts_grow_their_table_and_keep_every_fingerprint() -> None:
    ghosts = Ghosts(1)
    for fingerprint in range(1000):
        ghosts.append(0, hash(f"key-{fingerprint}"))
    assert len(ghosts) == 1000
    assert all(ghosts.take(hash(f"key-{fingerprint}")) == 0 for fingerprint in range(999, -1, -1))
    assert ghosts.take(hash("never")) == NOT_LISTED
