"""Which blocks of which KV-cache group a hit needs, and which a store keeps: pure bookkeeping (no I/O, no vLLM).

vLLM's hybrid allocator gives each KV-cache group its own block table
(docs/engines.md, "Hybrid and sliding-window models"). A full-attention group
needs every block of a prefix; a sliding-window group only the
``window_blocks`` blocks before the hit's end (vLLM frees the rest and puts its
null block, id 0, in their place). So a hit of ``end`` blocks is a set of
(group, position) entries, the full groups' interleaved position by position
(their longest run is a prefix), then each sliding group's window.

A sliding group's block is worth storing only inside the window of an end a
later request can hit: the prompt's end (a request that repeats or continues
the prompt) and everything after it (a chat's next turn continues the answer),
and the anchors, every ``ANCHOR_WINDOWS`` windows (a prompt that shares only a
prefix hits at the last anchor inside it). A lookup tries the request's own end;
where an entry is missing, no end above its position can be whole, so it tries
that position next, and so on down: the longest end held whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry

NULL_BLOCK = 0
"""vLLM's null block: a position a sliding window has left. Never copied from or into."""
ANCHOR_WINDOWS = 4
"""Anchor ends lie every this many (largest) windows: a sliding group stores at most 1/4 of a long prefix's blocks
before the prompt's last window, and a prompt sharing a prefix loses at most 4 windows of it."""

MAX_TRIES = ANCHOR_WINDOWS + 2
"""Lookups of one request before it only tries anchors (the ends below a prefix's reach are at most
``ANCHOR_WINDOWS`` windows apart when only anchors hold windows)."""

class HitEntry(NamedTuple):
    """One block of a hit: its KV-cache group and its position in the request."""

    group: int
    position: int


class PairedBlock(NamedTuple):
    """A CPU slot and the vLLM block of one group it is copied into (a load) or out of (a store)."""

    slot: int
    group: int
    block: int


def anchor_spacing(geometry: SlotGeometry) -> int:
    """Blocks between anchor ends (0: no sliding group, every end is an anchor)."""
    windows = [group.window_blocks for group in geometry.groups if group.kind is not GroupKind.FULL]
    return ANCHOR_WINDOWS * max(max(windows), 1) if windows else 0


def hit_entries(geometry: SlotGeometry, skip: int, end: int) -> list[HitEntry]:
    """What a hit of blocks ``skip..end`` (vLLM holding the first ``skip``) must load, in lookup order."""
    full = [index for index, group in enumerate(geometry.groups) if group.kind is GroupKind.FULL]
    entries = [HitEntry(index, position) for position in range(skip, end) for index in full]
    for index, group in enumerate(geometry.groups):
        if group.kind is not GroupKind.FULL:
            entries.extend(HitEntry(index, position) for position in range(max(skip, end - group.window_blocks), end))
    return entries


def next_end(geometry: SlotGeometry, skip: int, missing: int, tries: int) -> int | None:
    """After a lookup found every entry before one at block position ``missing`` (no end above it can be whole):
    the next end to try (None: no hit). ``missing`` itself; from the ``MAX_TRIES``-th try on, the last anchor at or
    below it, so a prefix held only at anchors costs a few lookups."""
    end = missing
    spacing = anchor_spacing(geometry)
    if tries >= MAX_TRIES and spacing:
        end = missing // spacing * spacing
    return end if end > skip else None


def kept_positions(geometry: SlotGeometry, group: int, start: int, end: int, prompt_blocks: int) -> list[int]:
    """The positions ``start..end`` of ``group`` a store keeps (every one for full attention)."""
    spec = geometry.groups[group]
    if spec.kind is GroupKind.FULL:
        return list(range(start, end))
    tail = prompt_blocks - spec.window_blocks - 1  # the windows of the prompt's end and of one block before it
    spacing = anchor_spacing(geometry)
    return [p for p in range(start, end) if p >= tail or p % spacing >= spacing - spec.window_blocks]


def group_key(key: bytes, group: int, geometry: SlotGeometry) -> bytes:
    """The key of ``group``'s block at a position whose chained key is ``key`` (itself for a one-group model)."""
    if len(geometry.groups) == 1:
        return key
    salt = group.to_bytes(16, "little")
    return hashlib.blake2b(key, digest_size=len(key), person=b"tc-vllm-group", salt=salt).digest()


def paired(entries: Sequence[HitEntry], slots: Sequence[int], block_ids: Sequence[Sequence[int]],
           end: int) -> list[PairedBlock]:
    """Each entry below ``end`` whose block vLLM allocated, with its slot (null blocks left alone)."""
    pairs = []
    for (group, position), slot in zip(entries, slots, strict=False):
        blocks = block_ids[group]
        if position < end and position < len(blocks) and blocks[position] != NULL_BLOCK:
            pairs.append(PairedBlock(slot, group, blocks[position]))
    return pairs


def tokens_by_tier(entries: Sequence[HitEntry], tiers: Sequence[str], names: Sequence[str], end: int,
                   block_size: int) -> dict[int, int]:
    """Tokens of the positions below ``end`` a load brings, by tier index (``names``' order): a position counts
    under the farthest tier any of its groups' blocks came from."""
    index = {name: i for i, name in enumerate(names)}
    farthest: dict[int, int] = {}
    for (_, position), tier in zip(entries, tiers, strict=False):
        if position < end:
            farthest[position] = max(farthest.get(position, 0), index.get(tier, 0))
    tokens: dict[int, int] = {}
    for tier in farthest.values():
        tokens[tier] = tokens.get(tier, 0) + block_size
    return tokens
