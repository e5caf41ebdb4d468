"""Eviction policies: exactness against libCacheSim, and pinning/removal properties.

The exactness tests replay the same generated traces through our policies (the
libCacheSim-style loop of policies/base.py) and through libCacheSim's C simulator
(oracleGeneral files, unit sizes), and require identical miss ratios. The
property tests drive random operations with a random pinned set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import libcachesim as lcs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.policy_reference import LIBCACHESIM, cache_size, libcachesim_miss_ratio

from tiercache.bookkeeping.slots import SlotTable
from tiercache.policies import POLICIES, KeyedPolicy, keyed_policy, make_policy, policy_class
from tiercache.policies.arc import ARCPolicy
from tiercache.policies.base import Key
from tiercache.testing.policy_traces import TRACES, Trace, oracle_traces

TRACE_LENGTH = 60_000
"""Requests per exactness trace: long enough for every policy to adapt, a second or so each."""

SIZE_FRACTIONS = (0.01, 0.05, 0.2)
"""Cache sizes as fractions of a trace's distinct keys."""

EXACT = 1e-9

NON_DEFAULT_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("s3fifo", {"small_ratio": 0.2, "ghost_ratio": 0.5, "move_to_main_threshold": 1}),
    ("s3fifo", {"small_ratio": 0.05, "ghost_ratio": 1.0, "move_to_main_threshold": 3}),
    ("twoq", {"in_ratio": 0.1, "out_ratio": 1.0}),
]


def simulate(policy: KeyedPolicy, trace: Iterable[Key]) -> list[bool]:
    """Replay ``trace`` with the loop of policies/base.py; the hit (True) or miss of each request."""
    hits = []
    for key in trace:
        hit = policy.access(key)
        if not hit:
            while len(policy) >= policy.capacity:
                policy.evict(incoming=key)
            policy.insert(key)
        hits.append(hit)
    return hits


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Trace, Path]]:
    """Each named trace and its oracleGeneral file."""
    return oracle_traces(tmp_path_factory.mktemp("traces"), TRACE_LENGTH)


def assert_same_miss_ratio(name: str, options: dict[str, Any], trace: Trace, path: Path, size: int) -> None:
    ours = 1.0 - sum(simulate(keyed_policy(name, size, **options), trace)) / len(trace)
    theirs = libcachesim_miss_ratio(LIBCACHESIM[name](size, **options), path)
    assert 0.0 < theirs < 1.0, "a degenerate trace could not tell policies apart"
    assert abs(ours - theirs) <= EXACT, f"{name}{options} c={size}: ours {ours} libCacheSim {theirs}"


@pytest.mark.parametrize("fraction", SIZE_FRACTIONS)
@pytest.mark.parametrize("trace_name", sorted(TRACES))
@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
def test_miss_ratio_equals_libcachesim(
    traces: dict[str, tuple[Trace, Path]], name: str, trace_name: str, fraction: float
) -> None:
    trace, path = traces[trace_name]
    assert_same_miss_ratio(name, {}, trace, path, cache_size(trace, fraction))


@pytest.mark.parametrize(("name", "options"), NON_DEFAULT_OPTIONS)
def test_options_match_libcachesim_parameters(
    traces: dict[str, tuple[Trace, Path]], name: str, options: dict[str, Any]
) -> None:
    trace, path = traces["zipf_scan"]
    assert_same_miss_ratio(name, options, trace, path, cache_size(trace, SIZE_FRACTIONS[1]))


@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
def test_each_request_agrees_with_libcachesim(traces: dict[str, tuple[Trace, Path]], name: str) -> None:
    """Hit for hit, through libCacheSim's per-request API: a failure names the first request."""
    trace, _ = traces["chat"]
    size = cache_size(trace, SIZE_FRACTIONS[1])
    ours = simulate(keyed_policy(name, size), trace)
    cache = LIBCACHESIM[name](size)
    for i, key in enumerate(trace):
        theirs = cache.get(lcs.Request(obj_size=1, obj_id=key, clock_time=i))
        assert ours[i] == theirs, f"{name}: request {i} (key {key}) differs"


def test_a_different_policy_is_detected(traces: dict[str, tuple[Trace, Path]]) -> None:
    """The comparison can fail: a changed promotion threshold changes the miss ratio."""
    trace, path = traces["zipf_scan"]
    size = cache_size(trace, SIZE_FRACTIONS[1])
    ours = 1.0 - sum(simulate(keyed_policy("s3fifo", size, move_to_main_threshold=1), trace)) / len(trace)
    assert abs(ours - libcachesim_miss_ratio(LIBCACHESIM["s3fifo"](size), path)) > EXACT


# --- registry and options ---------------------------------------------------------------


def test_registry_names_every_policy() -> None:
    assert set(POLICIES) >= {"lru", "arc", "s3fifo", "twoq"}
    for name in POLICIES:
        assert policy_class(name).name == name
        assert len(make_policy(name, 10)) == 0


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("s3fifo", {"small_ratio": 1.0}),
        ("s3fifo", {"move_to_main_threshold": 4}),
        ("s3fifo", {"ghost_ratio": -0.1}),
        ("twoq", {"in_ratio": -0.1}),
        ("twoq", {"out_ratio": -1.0}),
    ],
)
def test_bad_options_are_rejected(name: str, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=name):
        make_policy(name, 100, **options)


@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
def test_capacity_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_policy(name, 0)


# --- pinning and removal ----------------------------------------------------------------

MAX_KEY = 11
KEYS = st.integers(min_value=0, max_value=MAX_KEY)
OPS = st.lists(
    st.tuples(st.sampled_from(["access", "access", "access", "remove", "pin", "unpin"]), KEYS),
    max_size=200,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=MAX_KEY), ops=OPS)
@example(capacity=2, ops=[("access", 0), ("access", 1), ("pin", 0), ("access", 2)])
def test_pinned_keys_are_never_evicted(name: str, capacity: int, ops: list[tuple[str, int]]) -> None:
    """Random accesses, removals and pins against a model of the resident set.

    A miss evicts like a tier: only when some resident key is unpinned (else the
    insert is refused), never a pinned key, and len/contains/access always agree
    with the model.
    """
    policy = keyed_policy(name, capacity)
    resident: set[int] = set()
    pinned: set[int] = set()

    def can_evict(key: Key) -> bool:
        return key not in pinned

    for op, key in ops:
        if op == "pin":
            pinned.add(key)
        elif op == "unpin":
            pinned.discard(key)
        elif op == "remove":
            policy.remove(key)
            resident.discard(key)
        else:
            assert policy.access(key) == (key in resident)
            if key not in resident:
                admitted = _make_room(policy, resident, pinned, can_evict, key)
                if admitted:
                    policy.insert(key)
                    resident.add(key)
        assert len(policy) == len(resident) <= capacity
        for k in range(MAX_KEY + 1):
            assert (k in policy) == (k in resident)


def _make_room(
    policy: KeyedPolicy,
    resident: set[int],
    pinned: set[int],
    can_evict: Callable[[Key], bool],
    incoming: int,
) -> bool:
    """Evict until there is room for ``incoming``; False (nothing evicted) if it cannot."""
    needed = len(resident) - policy.capacity + 1
    if needed > len(resident - pinned):
        return False
    for _ in range(max(needed, 0)):
        victim = policy.evict(can_evict, incoming=incoming)
        assert victim in resident and victim not in pinned
        assert victim not in policy
        resident.remove(victim)
    return True


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_removed_key_is_a_miss_and_frees_room(name: str) -> None:
    policy = keyed_policy(name, 4)
    for key in range(4):
        assert not policy.access(key)
        policy.insert(key)
    policy.remove(2)
    policy.remove(99)  # absent: no-op
    assert 2 not in policy and len(policy) == 3
    assert not policy.access(2)
    policy.insert(2)
    assert policy.access(2) and len(policy) == 4


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_all_pinned_but_one_evicts_that_one(name: str) -> None:
    policy = keyed_policy(name, 8)
    simulate(policy, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 1, 2])
    for free in range(1, 9):
        victim = policy.evict(lambda key, free=free: key == free, incoming=100)
        assert victim == free and free not in policy
        policy.insert(free)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(min_value=1, max_value=MAX_KEY),
    batches=st.lists(st.lists(KEYS, max_size=MAX_KEY + 1), max_size=40),
    removals=st.lists(KEYS, max_size=20),
)
def test_arc_directory_stays_bounded_when_room_is_made_first(
    capacity: int, batches: list[list[int]], removals: list[int]
) -> None:
    """A tier evicts a batch before it inserts (and removes keys): ARC's bounds still hold.

    |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (Megiddo & Modha, section III).
    """
    policy = KeyedPolicy(ARCPolicy(capacity))
    for batch_index, batch in enumerate(batches):
        for key in batch:
            if key in policy:
                assert policy.access(key)
        misses = list(dict.fromkeys(key for key in batch if key not in policy))[:capacity]
        for _ in range(len(policy) + len(misses) - capacity):
            policy.evict()
        for key in misses:
            assert not policy.access(key)
            policy.insert(key)
        if batch_index < len(removals):
            policy.remove(removals[batch_index])
        t1, t2, b1, b2 = policy.policy.list_lengths()
        assert t1 + t2 == len(policy) <= capacity
        assert t1 + b1 <= capacity
        assert t1 + t2 + b1 + b2 <= 2 * capacity


def replay_through_slot_table(name: str, size: int, trace: Trace) -> float:
    """Miss ratio of ``trace`` driven through a tier's SlotTable the way the hierarchy drives it.

    A hit is a ``touch``; a miss is a ``begin_write`` (the policy sees the request,
    then a victim is chosen, then the key is admitted) and the write's commit. Keys
    are integers here, which the table accepts as well as block keys.
    """
    table = SlotTable(size, make_policy(name, size))
    misses = 0
    for key in trace:
        if table.readable(key) is not None:
            table.touch(key)
            continue
        misses += 1
        slot, _victims = table.begin_write(key)
        table.commit_write(slot)
    table.check_invariants()
    return misses / len(trace)


@pytest.mark.parametrize("fraction", SIZE_FRACTIONS[:2])
@pytest.mark.parametrize("trace_name", sorted(TRACES))
@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
def test_a_tier_replaying_a_trace_makes_libcachesims_decisions(
    traces: dict[str, tuple[Trace, Path]], name: str, trace_name: str, fraction: float
) -> None:
    """Exact inside a tier too, not only as a bare policy: the slot table keeps the policy's order of calls."""
    trace, path = traces[trace_name]
    size = cache_size(trace, fraction)
    theirs = libcachesim_miss_ratio(LIBCACHESIM[name](size), path)
    assert abs(replay_through_slot_table(name, size, trace) - theirs) <= EXACT
