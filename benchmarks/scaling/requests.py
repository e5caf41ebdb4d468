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
The reference is a second ``LowerTiers`` with one request of the same B in flight, its new requests taking turns
with the loaded one's in the same cell (so a drift of the machine falls on both alike): ``growth`` is a new
request's median total with N in flight over the reference's; the loaded tiers grow from one cell to the next.
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
NEW_REQUESTS = 9
"""New requests timed at each size, on each side (medians)."""
SLOW_REMOTE_MS = 600_000.0
"""The remote's answer time: longer than any run, so every presence check stays in flight."""
FILL_BUDGET_S = 600.0
"""A cell whose N requests take longer than this to look up is cut short (and says so): before a fix, the
largest cells take hours."""
QUICK = {"REQUESTS": (1, 4), "BLOCKS": (16,), "NEW_REQUESTS": 2}
"""The sizes ``--quick`` takes."""
PHASES = ("hash", "first_lookup", "retry", "store", "cpu_hit", "forget")


def _tiers(cpu_blocks: int) -> LowerTiers:
    data = {"model": {"id": "scale-requests"}, "layout": {"block_bytes": BLOCK_BYTES, "block_size": BLOCK_SIZE},
            "tiers": [{"type": "cpu", "capacity_blocks": cpu_blocks, "policy": "lru"},
                      {"type": "simulated", "name": "slow",
                       "options": {"latency_ms": SLOW_REMOTE_MS, "timeout_ms": SLOW_REMOTE_MS}}],
            "queues": {"remote_lookup_timeout_ms": 2 * SLOW_REMOTE_MS}}
    tiers = LowerTiers(config_from_dict(data, environ={}, engine_pool=True))
    tiers.start()
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


def _step_us(tiers: LowerTiers, requests: list[int], blocks: int) -> float:
    """µs a request of one step's retried lookups of ``requests`` (their hashing included, as a step hashes)."""
    started = time.perf_counter()
    for request in requests:
        assert tiers.lookup(tiers.hasher.keys(_tokens(request, blocks)), asker=request) is None
    return (time.perf_counter() - started) * 1e6 / max(len(requests), 1)


class _Tiers:
    """A ``LowerTiers`` with requests in flight (each looked up once, its presence check out) and its next ids."""

    def __init__(self, blocks: int, cpu_blocks: int) -> None:
        self.tiers, self.blocks, self.next_id = _tiers(cpu_blocks), blocks, 0
        self.flying: list[int] = []
        """The requests in flight."""

    @property
    def in_flight(self) -> int:
        return len(self.flying)

    def fill(self, requests: int, budget_s: float) -> None:
        started = time.perf_counter()
        while self.in_flight < requests and time.perf_counter() - started < budget_s:
            request = self._id()
            assert self.tiers.lookup(self.tiers.hasher.keys(_tokens(request, self.blocks)), asker=request) is None
            self.flying.append(request)

    def new_request(self) -> dict[str, float]:
        return _new_request(self.tiers, self._id(), self.blocks)

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _cell(loaded: _Tiers, reference: _Tiers, requests: int, new_requests: int) -> dict[str, Any]:
    """``requests`` in flight in ``loaded``, one in ``reference``: new requests taking turns between the two."""
    blocks = loaded.blocks
    started = time.perf_counter()
    loaded.fill(requests, FILL_BUDGET_S)
    fill_s = time.perf_counter() - started
    frozen_heap()
    try:
        timed: dict[str, list[dict[str, float]]] = {"loaded": [], "reference": []}
        for _ in range(new_requests):
            timed["loaded"].append(loaded.new_request())
            timed["reference"].append(reference.new_request())
        step = _step_us(loaded.tiers, loaded.flying, blocks)
        reference_step = statistics.median(_step_us(reference.tiers, reference.flying, blocks)
                                           for _ in range(new_requests))
    finally:
        gc.unfreeze()
    total = {side: statistics.median(sum(times.values()) for times in runs) for side, runs in timed.items()}
    return {"requests": requests, "blocks": blocks, "in_flight": loaded.in_flight,
            "keys_held": loaded.in_flight * blocks, "fill_s": fill_s, "new_request_us": total["loaded"],
            "new_request_us_per_block": total["loaded"] / blocks, "reference_us": total["reference"],
            "phases_us": {phase: statistics.median(times[phase] for times in timed["loaded"]) for phase in PHASES},
            "step_us_per_request": step, "reference_step_us": reference_step,
            "growth": total["loaded"] / total["reference"], "step_growth": step / reference_step,
            "complete": loaded.in_flight == requests}


def run(quick: bool) -> dict[str, Any]:
    sizes = QUICK if quick else {"REQUESTS": REQUESTS, "BLOCKS": BLOCKS, "NEW_REQUESTS": NEW_REQUESTS}
    rows = []
    for blocks in sizes["BLOCKS"]:
        stored = 2 * blocks * sizes["NEW_REQUESTS"] * len(sizes["REQUESTS"])
        reference, loaded = _Tiers(blocks, stored), _Tiers(blocks, stored)
        try:
            reference.fill(1, FILL_BUDGET_S)
            rows += [_cell(loaded, reference, requests, sizes["NEW_REQUESTS"]) for requests in sizes["REQUESTS"]]
        finally:
            loaded.tiers.close()
            reference.tiers.close()
    return {"block_bytes": BLOCK_BYTES, "block_size": BLOCK_SIZE, "slow_remote_ms": SLOW_REMOTE_MS, "rows": rows}


def table(section: dict[str, Any]) -> list[str]:
    lines = ["| blocks a request | requests in flight | keys held | new request (µs) | µs a block "
             "| with 1 in flight, beside it (µs) | growth "
             "| hash / first lookup / retry / store / cpu hit / forget (µs) | step, µs a request | step growth "
             "| filling them (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in section["rows"]:
        phases = " / ".join(f"{row['phases_us'][phase]:.0f}" for phase in PHASES)
        held = f"{row['keys_held']:,}" + ("" if row["complete"] else " (cut short)")
        lines.append(f"| {row['blocks']} | {row['requests']} | {held} | {row['new_request_us']:.0f} "
                     f"| {row['new_request_us_per_block']:.2f} | {row['reference_us']:.0f} | {row['growth']:.2f}x "
                     f"| {phases} "
                     f"| {row['step_us_per_request']:.0f} | {row['step_growth']:.2f}x | {row['fill_s']:.2f} |")
    return lines
