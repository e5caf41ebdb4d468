"""A small hit's fixed cost and the CPU tier's bulk copy rate, each against a bare memcpy timed in the same run.

1. One block (16 KiB, 128 KiB, 2 MiB) hit in the CPU tier, round after round,
   through ``TierManager`` (configs/default.yaml's topology: a GPU pool, here on
   the CPU device, over a write-through CPU tier; the hit: lookup, load into a
   fresh GPU block, ``result()``; the ``allocate`` of that block is timed apart,
   an engine allocates a request's blocks hit or miss) and through ``LowerTiers``
   (lookup, fetch, the engine's own copy out of the slot: one numpy memcpy;
   release). The ceiling: a dict lookup and one memcpy of the block between
   preallocated buffers (numpy ``copyto``; not torch's ``copy_``, whose intra-op
   threads, woken for a copy, then spin on the second core and slow whatever
   runs next), cycling over as many sources and destinations as the tiers do, so
   caches favour neither. Every path takes its turn in each round. Target: a
   hit's p50 at most 3x the ceiling's at 128 KiB and 2 MiB.
2. Bulk: blocks of 80 MiB (16 tokens of 5 MiB, the Vineyard write-up's shape),
   four a call, stored from the GPU pool into the CPU tier (the write-through
   copy) and loaded back into the pool, against a bare memcpy (numpy) of the
   same bytes between warm buffers in the same rounds (medians of rounds). The
   first rounds write CPU slots never written before, the later ones reuse slots:
   one row each. Target: at least 0.8x the memcpy rate.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiercache.config import config_from_dict
from tiercache.manager.lower_tiers import LowerTiers
from tiercache.manager.tier_manager import TierManager

NAME = "small_hit"
BLOCK_SIZE = 16
SMALL_LAYOUTS = {
    "16 KiB": {"num_layers": 1, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": BLOCK_SIZE},
    "128 KiB": {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": BLOCK_SIZE},
    "2 MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": BLOCK_SIZE},
}
"""One block of each size; 128 KiB is configs/default.yaml's layout."""
BULK_LAYOUT = {"num_layers": 80, "num_kv_heads": 128, "head_dim": 128, "dtype": "bfloat16", "block_size": BLOCK_SIZE}
"""80 MiB a block: 16 tokens of 5 MiB."""
GPU_BLOCKS = 64
"""The small-hit pool (configs/default.yaml's 256, scaled down so that 2 MiB blocks stay small beside the rest)."""
TARGET_HIT_RATIO = 3.0
"""Issue 51: a one-block hit's p50 at most this many times the ceiling's ..."""
TARGET_HIT_SIZES = ("128 KiB", "2 MiB")
"""... at these block sizes."""
TARGET_BULK_RATIO = 0.8
"""Issue 51: bulk stores and loads at least this share of the memcpy rate."""
US = 1e6
"""Microseconds a second."""
P99 = 0.99
"""The tail percentile reported."""


@dataclass(frozen=True)
class SmallHitSizes:
    """How much a run measures."""

    rounds: int = 3000
    """Timed rounds per block size (every path once a round; p99 needs thousands)."""
    warm_rounds: int = 200
    """Untimed rounds first (allocators, caches and the interpreter warm)."""
    prompts: int = 160
    """Distinct one-block prompts cycled through: more than the pool holds, so each lookup finds its block in the
    CPU tier only (its last GPU copy was evicted since), and enough that the copies' sources are not all in cache."""
    bulk_blocks: int = 4
    """80 MiB blocks a bulk call: 320 MiB."""
    bulk_rounds: int = 12
    """Bulk rounds: a store each, a load each but the first."""
    first_write_rounds: int = 3
    """The first bulk rounds, whose stores write CPU slots never written: the CPU tier holds this many calls (at
    least 3, so that the prompt a round loads is still there)."""
    bulk_layout: dict[str, Any] = field(default_factory=lambda: BULK_LAYOUT)


FULL = SmallHitSizes()
QUICK = SmallHitSizes(rounds=40, warm_rounds=5, prompts=80, bulk_blocks=2, bulk_rounds=5,
                      bulk_layout={**BULK_LAYOUT, "num_layers": 1})
"""``--quick``: seconds; its bulk blocks are 1 MiB."""


def run(quick: bool) -> dict[str, Any]:
    """The section: a row per block size (p50/p99 of each path, the ceiling, the ratios), then the bulk rows."""
    sizes = QUICK if quick else FULL
    load_start = os.getloadavg()
    rows = [small_row(label, layout, sizes) for label, layout in SMALL_LAYOUTS.items()]
    bulk = bulk_rows(sizes)
    return {
        "rows": rows,
        "bulk": bulk,
        "rounds": sizes.rounds,
        "bulk_rounds": sizes.bulk_rounds,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "targets": {"hit_p50_over_ceiling": TARGET_HIT_RATIO, "hit_sizes": list(TARGET_HIT_SIZES),
                    "bulk_over_memcpy": TARGET_BULK_RATIO},
    }


def table(section: dict[str, Any]) -> list[str]:
    """Markdown: the one-block hits (µs), then the bulk copies (GB/s)."""
    lines = [
        "| block | TierManager hit p50 / p99 (µs) | + allocate p50 | LowerTiers p50 / p99 (µs) "
        "| memcpy + dict p50 (µs) | TierManager / ceiling | LowerTiers / ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in section["rows"]:
        hit, lower = row["tier_manager"], row["lower_tiers"]
        lines.append(
            f"| {row['block']} | {hit['p50_us']:.0f} / {hit['p99_us']:.0f} | {row['allocate']['p50_us']:.0f} "
            f"| {lower['p50_us']:.0f} / {lower['p99_us']:.0f} | {row['ceiling_p50_us']:.1f} "
            f"| {row['tier_manager_ratio']:.2f}x | {row['lower_tiers_ratio']:.2f}x |"
        )
    lines += ["", "| bulk call | slots | tiercache GB/s | memcpy GB/s | ratio |", "|---|---|---|---|---|"]
    for row in section["bulk"]:
        lines.append(
            f"| {row['direction']} {row['blocks']} x {row['block_mib']:.0f} MiB | {row['slots']} | {row['gb_s']:.2f} "
            f"| {row['memcpy_gb_s']:.2f} | {row['ratio']:.2f}x |"
        )
    return lines


# ---- one-block hits ------------------------------------------------------------------------
def small_row(label: str, layout: dict[str, Any], sizes: SmallHitSizes) -> dict[str, Any]:
    """One block size: the tiers' hits and the ceilings, each path once a round."""
    mgr = manager(layout, GPU_BLOCKS, sizes.prompts + GPU_BLOCKS, "s3fifo")
    lower = LowerTiers(config_from_dict(
        {"model": {"id": "small-hit"}, "layout": layout,
         "tiers": [{"type": "cpu", "capacity_blocks": sizes.prompts, "policy": "s3fifo"}]},
        environ={}, engine_pool=True))
    lower.start()
    samples: dict[str, list[float]] = {name: [] for name in ("tier_manager", "allocate", "lower_tiers", "memcpy")}
    try:
        block_bytes = mgr.layout.bytes_per_block
        manager_hit = manager_hits(mgr, sizes.prompts)
        timed: dict[str, Callable[[int], None]] = {
            "lower_tiers": lower_hits(lower, sizes.prompts),
            "memcpy": memcpy(sizes.prompts, block_bytes),
        }
        for index in range(sizes.warm_rounds + sizes.rounds):
            hit_s, allocate_s = manager_hit(index)
            times = {"tier_manager": hit_s, "allocate": allocate_s}
            for name, path in timed.items():
                started = time.perf_counter()
                path(index)
                times[name] = time.perf_counter() - started
            if index >= sizes.warm_rounds:
                for name, seconds in times.items():
                    samples[name].append(seconds)
    finally:
        mgr.close_blocking()
        lower.close()
    stats = {name: percentiles(values) for name, values in samples.items()}
    ceiling = stats["memcpy"]["p50_us"]
    return {
        "block": label,
        "block_bytes": block_bytes,
        "tier_manager": stats["tier_manager"],
        "allocate": stats["allocate"],
        "lower_tiers": stats["lower_tiers"],
        "memcpy": stats["memcpy"],
        "ceiling_p50_us": ceiling,
        "tier_manager_ratio": stats["tier_manager"]["p50_us"] / ceiling,
        "lower_tiers_ratio": stats["lower_tiers"]["p50_us"] / ceiling,
    }


def manager(layout: dict[str, Any], gpu_blocks: int, cpu_slots: int, cpu_policy: str) -> TierManager:
    """A started manager: a GPU pool on the CPU device over a write-through CPU tier (configs/default.yaml)."""
    tiers = [
        {"name": "gpu", "type": "gpu", "capacity_blocks": gpu_blocks, "policy": "lru", "options": {"device": "cpu"}},
        {"name": "cpu", "type": "cpu", "capacity_blocks": cpu_slots, "policy": cpu_policy,
         "write_policy": "write_through"},
    ]
    mgr = TierManager(config_from_dict({"model": {"id": "small-hit"}, "layout": layout, "tiers": tiers}, environ={}))
    mgr.start_blocking()
    return mgr


def prompt(index: int, blocks: int = 1, salt: int = 0) -> list[int]:
    """The tokens of a distinct prompt of ``blocks`` blocks."""
    start = (salt * 1_000_003 + index) * blocks * BLOCK_SIZE
    return list(range(start, start + blocks * BLOCK_SIZE))


def manager_hits(mgr: TierManager, prompts: int) -> Callable[[int], tuple[float, float]]:
    """Store ``prompts`` one-block prompts (written through to the CPU tier); round ``i``'s hit, as the seconds of
    lookup + load + completion and of the ``allocate`` between them."""
    for index in range(prompts):
        ids = mgr.allocate(1, prompt(index))
        mgr.gpu.tensors[0][ids[0]].fill_(index % 251)
        mgr.store(prompt(index), ids).result()
        mgr.release(ids)
    tokens = [prompt(index) for index in range(prompts)]

    def hit(index: int) -> tuple[float, float]:
        wanted = tokens[index % prompts]
        started = time.perf_counter()
        found = mgr.lookup(wanted)
        looked_up = time.perf_counter()
        ids = mgr.allocate(1, wanted)
        allocated = time.perf_counter()
        loaded = mgr.load(found, ids).result()
        ended = time.perf_counter()
        mgr.release(ids)
        mgr.poll()  # as an engine's step does: the finished transfers are handed over
        if loaded != BLOCK_SIZE or found.tier_blocks.get("cpu") != 1:
            raise RuntimeError(f"small_hit: expected a one-block CPU hit, got {found.tier_blocks}, {loaded} tokens")
        return looked_up - started + ended - allocated, allocated - looked_up

    return hit


def lower_hits(lower: LowerTiers, prompts: int) -> Callable[[int], None]:
    """Write ``prompts`` one-block prompts into the CPU tier as an engine does; round ``i``'s hit (the engine's copy
    out of the slot included)."""
    chains = [lower.hasher.keys(prompt(index)) for index in range(prompts)]
    for index, keys in enumerate(chains):
        slots = lower.begin_writes(keys)
        if slots[0] is None:
            raise RuntimeError("small_hit: no CPU slot for a LowerTiers write")
        np.frombuffer(lower.buffer_view(slots[0]), dtype=np.uint8)[:] = index % 251
        lower.end_writes(keys, [slots[0]], [True])
    cpu = lower.parts.cpu
    assert cpu is not None
    buffer, destinations = cpu.buffer.numpy(), written((GPU_BLOCKS, lower.bytes_per_block), 0)

    def hit(index: int) -> None:
        found = lower.lookup(chains[index % prompts])
        if found is None or found.num_blocks != 1:
            raise RuntimeError("small_hit: expected a one-block CPU hit through LowerTiers")
        fetch = lower.fetch(found)
        np.copyto(destinations[index % GPU_BLOCKS], buffer[fetch.slots()[0]])
        fetch.release()

    return hit


def memcpy(prompts: int, block_bytes: int) -> Callable[[int], None]:
    """The ceiling: a dict lookup, then one memcpy (numpy ``copyto``) of a block between preallocated arrays."""
    sources, destinations = written((prompts, block_bytes), 3), written((GPU_BLOCKS, block_bytes), 0)
    names = [index.to_bytes(16, "little") for index in range(prompts)]
    row_of = {name: row for row, name in enumerate(names)}

    def copy(index: int) -> None:
        np.copyto(destinations[index % GPU_BLOCKS], sources[row_of[names[index % prompts]]])

    return copy


def written(shape: tuple[int, ...], value: int) -> np.ndarray:
    """A byte array filled with ``value``: written, so paged in (``np.zeros``'s pages would fault at the first copy,
    as the tiers' memory never does: see ``tiercache.tiers.cpu.page_in``)."""
    return np.full(shape, value, dtype=np.uint8)


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 in µs."""
    ordered = sorted(seconds)
    return {"p50_us": ordered[len(ordered) // 2] * US, "p99_us": ordered[int(len(ordered) * P99)] * US}


# ---- bulk copies ---------------------------------------------------------------------------
def bulk_rows(sizes: SmallHitSizes) -> list[dict[str, Any]]:
    """Stores (GPU pool -> CPU tier; into fresh slots, then reused ones) and loads (CPU tier -> GPU pool) of
    ``bulk_blocks`` big blocks a call, and the memcpy of as many bytes, each round.

    The pool holds one call's blocks and the CPU tier ``first_write_rounds`` calls'. Round ``r`` stores prompt
    ``r`` (its allocate evicts the pool's blocks, all in the CPU tier), then loads prompt ``r - 1`` from the CPU
    tier, evicted from the pool by that allocate.
    """
    blocks = sizes.bulk_blocks
    mgr = manager(sizes.bulk_layout, blocks, sizes.first_write_rounds * blocks, "lru")
    samples: dict[str, list[float]] = {"first_store": [], "store": [], "load": [], "memcpy": []}
    try:
        nbytes = blocks * mgr.layout.bytes_per_block
        source, target = written((nbytes,), 9), written((nbytes,), 0)
        for index in range(sizes.bulk_rounds):
            tokens = prompt(index, blocks, salt=1)
            ids = mgr.allocate(blocks, tokens)
            started = time.perf_counter()
            stored = mgr.store(tokens, ids).result()
            store_s = time.perf_counter() - started
            samples["first_store" if index < sizes.first_write_rounds else "store"].append(store_s)
            mgr.release(ids)
            if stored != blocks * BLOCK_SIZE:
                raise RuntimeError(f"small_hit: a bulk store indexed {stored} tokens")
            started = time.perf_counter()
            np.copyto(target, source)
            samples["memcpy"].append(time.perf_counter() - started)
            if index:
                samples["load"].append(bulk_load(mgr, prompt(index - 1, blocks, salt=1), blocks))
            mgr.poll()
    finally:
        mgr.close_blocking()
    memcpy_gb_s = nbytes / statistics.median(samples["memcpy"]) / 1e9
    rows = []
    for name, direction, slots in (("first_store", "store", "never written"), ("store", "store", "reused"),
                                   ("load", "load", "written")):
        gb_s = nbytes / statistics.median(samples[name]) / 1e9
        rows.append({"direction": direction, "slots": slots, "blocks": blocks, "block_mib": nbytes / blocks / 2**20,
                     "gb_s": gb_s, "memcpy_gb_s": memcpy_gb_s, "ratio": gb_s / memcpy_gb_s,
                     "rounds": len(samples[name])})
    return rows


def bulk_load(mgr: TierManager, tokens: list[int], blocks: int) -> float:
    """Seconds to load ``tokens`` (evicted from the pool, held by the CPU tier) into fresh pool blocks."""
    found = mgr.lookup(tokens)
    if found.tier_blocks.get("cpu") != blocks:
        raise RuntimeError(f"small_hit: expected a bulk CPU hit of {blocks} blocks, got {found.tier_blocks}")
    ids = mgr.allocate(blocks, tokens)
    started = time.perf_counter()
    loaded = mgr.load(found, ids).result()
    seconds = time.perf_counter() - started
    mgr.release(ids)
    if loaded != blocks * BLOCK_SIZE:
        raise RuntimeError(f"small_hit: a bulk load brought {loaded} tokens")
    return seconds
