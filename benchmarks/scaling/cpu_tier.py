"""CPU-tier capacity: µs a block for lookup, store and eviction under each policy, 10^4 to 10^7 blocks held.

Through ``LowerTiers`` with a CPU tier alone (what the vLLM connector's scheduler side calls), pages of
``BLOCK_BYTES`` (a small layout: this measures bookkeeping; the buffer is never touched). Per policy and capacity
C, on the caller's thread:

- ``store``: ``begin_writes`` and ``end_writes`` of batches of ``BATCH`` new blocks while the tier fills to C
  (timed over its last batches, the tier nearly full, nothing evicted);
- ``evict``: the same for blocks past C, each evicting one (a store that makes room);
- ``lookup``: ``lookup`` and ``release`` of a hit (pinned, then dropped) of ``BATCH`` blocks: a prompt's blocks
  as they were stored together (the engine's case), and as many held blocks drawn at random from the whole tier
  (the worst case for the machine's caches);
- ``dict``: the reference, a bare dict of C keys looked up at random in the same run (the machine's own growth:
  a large table's random accesses miss the CPU's caches whatever the code).

Growth is each figure at C over at the smallest C. Metadata a block: the Python objects the tier allocates
for it (``tracemalloc``, which sees no tensor memory), the 16-byte keys' own objects (49 bytes) counted too (a
ghost's as well: the tier is all that keeps it), at
``TRACED_BLOCKS`` blocks: an empty tier, once filled, and once as many more were stored, each evicting one (the
steady state, where ARC, 2Q and S3-FIFO keep their ghosts' keys). Tracing slows a fill threefold: the largest
size is not traced. The heap is frozen once a tier is built, as vLLM's engine core freezes its own.
"""

from __future__ import annotations

import gc
import hashlib
import random
import time
import tracemalloc
from typing import Any

from scaling.heap import frozen_heap
from tiercache.config import config_from_dict
from tiercache.manager.lower_tiers import LowerTiers
from tiercache.policies import POLICIES

NAME = "cpu_tier"
BLOCK_BYTES = 16
BLOCK_SIZE = 16
CAPACITIES = (10**4, 10**5, 10**6, 10**7)
BATCH = 512
"""Blocks a call: a prompt's worth."""
TIMED_BATCHES = 16
"""Batches timed for each figure (the last of the fill, the first past capacity, random lookups)."""
TRACED_BLOCKS = 10**6
SEED = 51
QUICK = {"CAPACITIES": (2_000, 8_000), "TRACED_BLOCKS": 4_000, "TIMED_BATCHES": 2}


def keys_for(count: int) -> list[bytes]:
    """``count`` distinct 16-byte keys (as the block hasher's digests)."""
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(count)]


def _tiers(policy: str, capacity: int) -> LowerTiers:
    data = {"model": {"id": "scale-cpu-tier"}, "layout": {"block_bytes": BLOCK_BYTES, "block_size": BLOCK_SIZE},
            "tiers": [{"type": "cpu", "capacity_blocks": capacity, "policy": policy}]}
    tiers = LowerTiers(config_from_dict(data, environ={}, engine_pool=True))
    tiers.start()
    frozen_heap()
    return tiers


def _store(tiers: LowerTiers, keys: list[bytes]) -> None:
    slots = tiers.begin_writes(keys)
    chosen = [(key, slot) for key, slot in zip(keys, slots, strict=True) if slot is not None]
    assert len(chosen) == len(keys), "a store found no room"
    tiers.end_writes([key for key, _ in chosen], [slot for _, slot in chosen], [True] * len(chosen))


def _timed_stores(tiers: LowerTiers, batches: list[list[bytes]]) -> float:
    """µs a block of storing ``batches``."""
    started = time.perf_counter()
    for batch in batches:
        _store(tiers, batch)
    return (time.perf_counter() - started) * 1e6 / sum(len(batch) for batch in batches)


def _batches(keys: list[bytes], start: int, stop: int) -> list[list[bytes]]:
    return [keys[i : min(i + BATCH, stop)] for i in range(start, stop, BATCH)]


def _cell(policy: str, capacity: int, keys: list[bytes], timed: int) -> dict[str, Any]:
    tiers = _tiers(policy, capacity)
    try:
        tail = capacity - timed * BATCH
        for batch in _batches(keys, 0, tail):
            _store(tiers, batch)
        gc.collect()
        store_us = _timed_stores(tiers, _batches(keys, tail, capacity))
        evict_us = _timed_stores(tiers, _batches(keys, capacity, capacity + timed * BATCH))
        held = keys[timed * BATCH : capacity + timed * BATCH]  # what LRU-like policies kept: the newest C
        cpu = tiers.parts.cpu
        assert cpu is not None
        drawn = random.Random(SEED).sample(held, min(len(held), 4 * timed * BATCH))
        resident = [key for key in drawn if key in cpu.table]
        scattered = [resident[i : i + BATCH] for i in range(0, len(resident) - BATCH + 1, BATCH)][:timed]
        stored = [batch for batch in _batches(keys, timed * BATCH, capacity + timed * BATCH)
                  if len(batch) == BATCH and all(key in cpu.table for key in batch)]
        prompts = random.Random(SEED).sample(stored, min(timed, len(stored)))
        lookup_us = _lookups_us(tiers, scattered)
        prompt_us = _lookups_us(tiers, prompts)
        evictions = cpu.table.evictions
    finally:
        tiers.close()
        gc.unfreeze()
    return {"policy": policy, "capacity_blocks": capacity, "store_us_per_block": store_us,
            "evict_us_per_block": evict_us, "lookup_us_per_block": lookup_us,
            "prompt_lookup_us_per_block": prompt_us, "evictions": evictions}


def _lookups_us(tiers: LowerTiers, batches: list[list[bytes]]) -> float:
    """µs a block of a hit's ``lookup`` and ``release`` of each of ``batches``."""
    started = time.perf_counter()
    for batch in batches:
        hit = tiers.lookup(batch, local_only=True)
        assert hit is not None and hit.num_blocks == len(batch)
        tiers.release(hit)
    return (time.perf_counter() - started) * 1e6 / max(1, sum(len(batch) for batch in batches))


def _dict_reference(capacity: int, keys: list[bytes], lookups: int) -> float:
    """µs a random lookup in a bare dict of ``capacity`` keys."""
    table = dict.fromkeys(keys[:capacity], 0)
    draws = random.Random(SEED).choices(keys[:capacity], k=lookups)
    started = time.perf_counter()
    for key in draws:
        table[key]
    return (time.perf_counter() - started) * 1e6 / lookups


def _metadata_bytes(policy: str, blocks: int, keys: list[bytes]) -> dict[str, float]:
    """Python bytes the tier holds a block (tracemalloc), the keys' objects included: once ``blocks`` are stored
    (``filled``), and once as many more have been stored, each evicting one (``steady``: ghosts full). The keys
    are copies made under the trace that only the tier keeps, so a ghost's key counts as the tier's."""
    gc.collect()
    tracemalloc.start()
    try:
        empty = tracemalloc.get_traced_memory()[0]
        tiers = _tiers(policy, blocks)
        sizes = {"empty_tier": tracemalloc.get_traced_memory()[0] - empty}
        for phase in ("filled", "steady"):
            source = keys[:blocks] if phase == "filled" else _evicting_keys(keys, blocks)
            stored = [bytes(bytearray(key)) for key in source]  # new objects: the tier keeps what it keeps
            del source
            for batch in _batches(stored, 0, blocks):
                _store(tiers, batch)
            del stored, batch
            gc.collect()
            sizes[phase] = tracemalloc.get_traced_memory()[0] - empty
    finally:
        tracemalloc.stop()
    tiers.close()
    return {name: size / blocks for name, size in sizes.items()}


def _evicting_keys(keys: list[bytes], blocks: int) -> list[bytes]:
    """``blocks`` keys none of ``keys[:blocks]`` is (reversed digests: distinct, and as random)."""
    return [key[::-1] for key in keys[:blocks]]


def run(quick: bool) -> dict[str, Any]:
    capacities = QUICK["CAPACITIES"] if quick else CAPACITIES
    traced = QUICK["TRACED_BLOCKS"] if quick else TRACED_BLOCKS
    timed = QUICK["TIMED_BATCHES"] if quick else TIMED_BATCHES
    keys = keys_for(max(*capacities, traced) + timed * BATCH)
    rows = []
    for capacity in capacities:
        reference = _dict_reference(capacity, keys, timed * BATCH * 4)
        for policy in POLICIES:
            row = _cell(policy, capacity, keys, timed)
            row["dict_lookup_us"] = reference
            rows.append(row)
            print(f"  {policy} {capacity:,}: store {row['store_us_per_block']:.2f} evict "
                  f"{row['evict_us_per_block']:.2f} lookup {row['lookup_us_per_block']:.2f} µs a block", flush=True)
    smallest = min(capacities)
    for row in rows:
        base = next(r for r in rows if r["policy"] == row["policy"] and r["capacity_blocks"] == smallest)
        row["growth"] = {op: row[f"{op}_us_per_block"] / base[f"{op}_us_per_block"]
                         for op in ("store", "evict", "lookup", "prompt_lookup")}
        row["dict_growth"] = row["dict_lookup_us"] / base["dict_lookup_us"]
    metadata = {policy: _metadata_bytes(policy, traced, keys) for policy in POLICIES}
    return {"block_bytes": BLOCK_BYTES, "batch": BATCH, "rows": rows,
            "metadata_bytes_per_block": metadata, "metadata_blocks": traced, "metadata_measure": "tracemalloc"}


def table(section: dict[str, Any]) -> list[str]:
    lines = ["| policy | blocks | lookup, a stored prompt (µs a block) | lookup, scattered blocks | store "
             "| store evicting | growth prompt / scattered / store / evict | bare dict lookup, scattered (µs) "
             "| its growth |", "|---|---|---|---|---|---|---|---|---|"]
    ops = ("prompt_lookup", "lookup", "store", "evict")
    for row in section["rows"]:
        growth = " / ".join(f"{row['growth'][op]:.2f}x" for op in ops)
        lines.append(f"| {row['policy']} | {row['capacity_blocks']:,} | {row['prompt_lookup_us_per_block']:.2f} "
                     f"| {row['lookup_us_per_block']:.2f} "
                     f"| {row['store_us_per_block']:.2f} | {row['evict_us_per_block']:.2f} | {growth} "
                     f"| {row['dict_lookup_us']:.3f} | {row['dict_growth']:.2f}x |")
    lines += ["", f"| policy | metadata a block ({section['metadata_measure']}, {section['metadata_blocks']:,} "
              "blocks, keys included): empty tier / filled / steady (as many more stored, each evicting one) |",
              "|---|---|"]
    lines += [f"| {policy} | {size['empty_tier']:.0f} / {size['filled']:.0f} / {size['steady']:.0f} B |"
              for policy, size in section["metadata_bytes_per_block"].items()]
    return lines
