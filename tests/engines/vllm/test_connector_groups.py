"""The connector's group bookkeeping (``connector/groups.py``), step by step against brute-force models.

What a sliding group stores is checked against its definition (the blocks inside
the window of some end a later request can hit); which end a lookup settles on
against every end checked one by one over what earlier requests stored.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.groups import (
    MAX_TRIES,
    anchor_spacing,
    group_key,
    hit_entries,
    kept_positions,
    next_end,
    paired,
)

PAGE = 1024


def geometry(pattern: str, window_blocks: int) -> SlotGeometry:
    """``F`` a full-attention group, ``S`` a sliding group of ``window_blocks`` (one layer each)."""
    groups = tuple(
        GroupGeometry(GroupKind.FULL if kind == "F" else GroupKind.SLIDING, (f"layer{i}",), PAGE,
                      0 if kind == "F" else window_blocks)
        for i, kind in enumerate(pattern)
    )
    return SlotGeometry(groups, 1, 16)


def reference_kept(spacing: int, window: int, prompt_blocks: int, position: int) -> bool:
    """Kept iff inside the window before some end a later request can hit: the prompt's end or one block short of
    it (a repeat), any end after it (a continued chat), an anchor."""
    ends = {prompt_blocks - 1, prompt_blocks, position + 1 if position >= prompt_blocks else -1}
    ends |= {k * spacing for k in range(1, position // spacing + 2)}
    return any(end - window <= position < end for end in ends if end > 0)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 80), st.integers(0, 100), st.sampled_from(["S", "SF", "SSSF", "FS"]))
def test_a_sliding_group_keeps_exactly_the_windows_of_ends_a_request_can_hit(
    window: int, prompt_blocks: int, extra: int, pattern: str
) -> None:
    shape = geometry(pattern, window)
    spacing = anchor_spacing(shape)
    assert spacing == 4 * window
    end = prompt_blocks + extra
    for group, spec in enumerate(shape.groups):
        # stored in steps of any size: the union of the steps is the whole
        kept = kept_positions(shape, group, 0, end // 2, prompt_blocks) + kept_positions(
            shape, group, end // 2, end, prompt_blocks)
        if spec.kind is GroupKind.FULL:
            assert kept == list(range(end))
        else:
            assert kept == [p for p in range(end) if reference_kept(spacing, window, prompt_blocks, p)]


def stored_entries(shape: SlotGeometry, prompt_blocks: int, computed_blocks: int) -> set[tuple[int, int]]:
    """The (group, position) entries one request's stores hold."""
    return {(group, position) for group in range(len(shape.groups))
            for position in kept_positions(shape, group, 0, computed_blocks, prompt_blocks)}


def search(shape: SlotGeometry, held: set[tuple[int, int]], skip: int, usable: int, *, capped: bool = True) -> int:
    """The connector's lookup loop over a store holding ``held``: the end it settles on (0: none); ``capped``
    False: never jumping to the anchors."""
    end: int | None = usable
    tries = 0
    while end is not None:
        entries = hit_entries(shape, skip, end)
        found = next((i for i, entry in enumerate(entries) if entry not in held), len(entries))
        if found == len(entries):
            return end
        tries += capped
        end = next_end(shape, skip, entries[found][1], tries)
    return 0


def valid_ends(shape: SlotGeometry, held: set[tuple[int, int]], skip: int, usable: int) -> list[int]:
    """Brute force: every end whose every entry is held."""
    return [end for end in range(skip + 1, usable + 1) if set(hit_entries(shape, skip, end)) <= held]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["S", "SF", "SSSF", "FF"]), st.integers(1, 5), st.integers(2, 60), st.integers(0, 30),
       st.integers(1, 90), st.integers(0, 3))
def test_after_one_request_a_lookup_finds_the_longest_end_it_can_use(
    pattern: str, window: int, prompt_blocks: int, output_blocks: int, shared: int, skip: int
) -> None:
    """A later request sharing ``shared`` blocks with one earlier request (its prompt and answer stored) settles
    on the longest end whose every block is held (each lookup skips only ends that cannot be whole); capped, at
    most ``MAX_TRIES`` lookups before the anchors, it finds the same when the window is not tiny."""
    shape = geometry(pattern, window)
    computed = prompt_blocks + output_blocks
    held = stored_entries(shape, prompt_blocks, computed)
    common = min(shared, computed)
    held = {(g, p) for g, p in held if p < common}  # the later request's keys differ after the shared blocks
    usable = max(shared, skip + 1)
    skip = min(skip, usable - 1)
    ends = valid_ends(shape, held, skip, usable)
    best = max(ends) if ends else 0
    assert search(shape, held, skip, usable, capped=False) == best
    if usable - best <= (MAX_TRIES - 1) * window:  # a new message shorter than the windows tried before anchors
        assert search(shape, held, skip, usable) == best


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["S", "SF", "SSSF"]), st.integers(1, 4),
       st.lists(st.tuples(st.integers(2, 50), st.integers(0, 20), st.integers(1, 70)), min_size=2, max_size=4),
       st.integers(1, 70))
def test_after_many_requests_a_lookup_is_sound_and_never_below_the_last_anchor(
    pattern: str, window: int, earlier: list[tuple[int, int, int]], usable: int
) -> None:
    """Over what several earlier requests left (each sharing a prefix with this one): every entry of the end found
    is held, and it is no shorter than the longest anchor end that is whole."""
    shape = geometry(pattern, window)
    held: set[tuple[int, int]] = set()
    for prompt_blocks, output_blocks, shared in earlier:
        stored = stored_entries(shape, prompt_blocks, prompt_blocks + output_blocks)
        held |= {(g, p) for g, p in stored if p < shared}
    found = search(shape, held, 0, usable)
    if found:
        assert set(hit_entries(shape, 0, found)) <= held
    spacing = anchor_spacing(shape)
    anchors = [end for end in valid_ends(shape, held, 0, usable) if end % spacing == 0]
    assert found >= max(anchors, default=0)


def test_group_keys_differ_by_group_and_a_single_group_keeps_the_chain_key() -> None:
    key = bytes(range(16))
    hybrid = geometry("SSSF", 2)
    assert len({group_key(key, group, hybrid) for group in range(4)}) == 4
    assert all(len(group_key(key, group, hybrid)) == len(key) for group in range(4))
    assert group_key(key, 0, geometry("F", 2)) == key


def test_null_blocks_are_never_paired() -> None:
    entries = [(0, 5), (0, 6), (1, 6), (1, 7)]
    block_ids = [[9, 9, 9, 9, 9, 0, 11], [0, 0, 0, 0, 0, 0, 21, 22]]
    assert paired(entries, [100, 101, 102, 103], block_ids, end=8) == [(101, 0, 11), (102, 1, 21), (103, 1, 22)]
    assert paired(entries, [100, 101, 102, 103], block_ids, end=7) == [(101, 0, 11), (102, 1, 21)]
