"""Requests in flight: the scheduler side's time per new request and per step through ``LowerTiers``.

What vLLM's scheduler thread calls through the connector, without vLLM: N requests of B blocks have each looked
up against a remote whose presence answers are slow (a ``simulated`` tier whose answers take longer than the
run), so every request keeps its keys and its presence check in flight. Then new requests arrive one at a time;
each is timed on the caller's thread:

- ``hash``: its B chained keys (``BlockHasher.keys``);
- ``first lookup``: ``lookup(keys, asker=)``, the presence check sent (pending);
- ``retry``: the next step's lookup, still pending;
- ``store``: ``begin_writes`` and ``end_writes`` of its B blocks (the engine's copy left out);
- ``cpu hit``: a lookup that finds those B blocks in the CPU tier, ``fetch``, ``slots`` and ``release``;
- ``forget``: the request finishing.

``step``: one retried lookup of every request in flight (what a scheduler step costs when N wait), per request.
The reference is N = 1 of the same B in the same run: ``growth`` is a new request's total at N over at 1.
The heap is frozen once the tiers are built, as vLLM's engine core freezes its own after start-up
(``freeze_gc_heap``): the garbage collector then scans what serving allocates, not the imports.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from scaling.heap import frozen_heap
from tiercache.config import config_from_dict
from tiercache.manager.lower_tiers import LowerTiers

NAME = "requests"
BLOCK_SIZE = 16
BLOCK_BYTES = 64
"""A small page: this sweep measures bookkeeping, not copies."""
REQUESTS = (1, 16, 64, 256, 1024)
BLOCKS = (64, 512, 2048)
NEW_REQUESTS = 7
"""New requests timed at each size (medians)."""
SLOW_REMOTE_MS = 600_000.0
"""The remote's answer time: longer than any run, so every presence check stays in flight."""
FILL_BUDGET_S = 600.0
"""A cell whose N requests take longer than this to look up is cut short (and says so): before a fix, the
largest cells take hours."""
QUICK = {"REQUESTS": (1, 4), "BLOCKS": (16,), "NEW_REQUESTS": 2}
PHASES = ("hash", "first_lookup", "retry", "store", "cpu_hit", "forget")


def _tiers(blocks: int, new_requests: int) -> LowerTiers:
    cpu_blocks = 2 * blocks * new_requests
    data = {"model": {"id": "scale-requests"}, "layout": {"block_bytes": BLOCK_BYTES, "block_size": BLOCK_SIZE},
            "tiers": [{"type": "cpu", "capacity_blocks": cpu_blocks, "policy": "lru"},
                      {"type": "simulated", "name": "slow",
                       "options": {"latency_ms": SLOW_REMOTE_MS, "timeout_ms": SLOW_REMOTE_MS}}],
            "queues": {"remote_lookup_timeout_ms": 2 * SLOW_REMOTE_MS}}
    tiers = LowerTiers(config_from_dict(data, environ={}, engine_pool=True))
    tiers.start()
    frozen_heap()
    return tiers


def _tokens(request: int, blocks: int) -> list[int]:
    base = request * blocks * BLOCK_SIZE
    return list(range(base, base + blocks * BLOCK_SIZE))


def _new_request(tiers: LowerTiers, request: int, blocks: int) -> dict[str, float]:
    """One new request's calls, each timed (µs)."""
    tokens = _tokens(request, blocks)
    times: dict[str, float] = {}
    started = time.perf_counter()
    keys = tiers.hasher.keys(tokens)
    times["hash"] = time.perf_counter() - started
    for phase in ("first_lookup", "retry"):
        started = time.perf_counter()
        assert tiers.lookup(keys, asker=request) is None, "the slow remote answered"
        times[phase] = time.perf_counter() - started
    started = time.perf_counter()
    slots = tiers.begin_writes(keys)
    chosen = [(key, slot) for key, slot in zip(keys, slots, strict=True) if slot is not None]
    tiers.end_writes([key for key, _ in chosen], [slot for _, slot in chosen], [True] * len(chosen))
    times["store"] = time.perf_counter() - started
    started = time.perf_counter()
    hit = tiers.lookup(keys, local_only=True, asker=request)
    assert hit is not None and hit.num_blocks == blocks, "the stored blocks are not a CPU hit"
    fetch = tiers.fetch(hit)
    assert len(fetch.slots()) == blocks
    fetch.release()
    times["cpu_hit"] = time.perf_counter() - started
    started = time.perf_counter()
    tiers.forget(request)
    times["forget"] = time.perf_counter() - started
    return {phase: seconds * 1e6 for phase, seconds in times.items()}


def _cell(requests: int, blocks: int, new_requests: int) -> dict[str, Any]:
    tiers = _tiers(blocks, new_requests)
    try:
        started = time.perf_counter()
        held = 0
        for request in range(requests):
            assert tiers.lookup(tiers.hasher.keys(_tokens(request, blocks)), asker=request) is None
            held += 1
            if time.perf_counter() - started > FILL_BUDGET_S:
                break
        fill_s = time.perf_counter() - started
        gc.collect()
        new = [_new_request(tiers, requests + i, blocks) for i in range(new_requests)]
        started = time.perf_counter()
        for request in range(held):
            assert tiers.lookup(tiers.hasher.keys(_tokens(request, blocks)), asker=request) is None
        step_s = time.perf_counter() - started
        phases = {phase: statistics.median(times[phase] for times in new) for phase in PHASES}
        total = statistics.median(sum(times.values()) for times in new)
        return {"requests": requests, "blocks": blocks, "in_flight": held, "keys_held": held * blocks,
                "fill_s": fill_s, "new_request_us": total, "new_request_us_per_block": total / blocks,
                "phases_us": phases, "step_us_per_request": step_s * 1e6 / max(held, 1),
                "complete": held == requests}
    finally:
        tiers.close()
        gc.unfreeze()


def run(quick: bool) -> dict[str, Any]:
    sizes = QUICK if quick else {"REQUESTS": REQUESTS, "BLOCKS": BLOCKS, "NEW_REQUESTS": NEW_REQUESTS}
    rows = [_cell(requests, blocks, sizes["NEW_REQUESTS"])
            for blocks in sizes["BLOCKS"] for requests in sizes["REQUESTS"]]
    for row in rows:
        reference = next(r for r in rows if r["blocks"] == row["blocks"] and r["requests"] == min(sizes["REQUESTS"]))
        row["growth"] = row["new_request_us"] / reference["new_request_us"]
        row["step_growth"] = row["step_us_per_request"] / reference["step_us_per_request"]
    return {"block_bytes": BLOCK_BYTES, "block_size": BLOCK_SIZE, "slow_remote_ms": SLOW_REMOTE_MS, "rows": rows}


def table(section: dict[str, Any]) -> list[str]:
    lines = ["| blocks a request | requests in flight | keys held | new request (µs) | µs a block | growth vs 1 "
             "| hash / first lookup / retry / store / cpu hit / forget (µs) | step, µs a request | step growth "
             "| filling them (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in section["rows"]:
        phases = " / ".join(f"{row['phases_us'][phase]:.0f}" for phase in PHASES)
        held = f"{row['keys_held']:,}" + ("" if row["complete"] else " (cut short)")
        lines.append(f"| {row['blocks']} | {row['requests']} | {held} | {row['new_request_us']:.0f} "
                     f"| {row['new_request_us_per_block']:.2f} | {row['growth']:.2f}x | {phases} "
                     f"| {row['step_us_per_request']:.0f} | {row['step_growth']:.2f}x | {row['fill_s']:.2f} |")
    return lines
