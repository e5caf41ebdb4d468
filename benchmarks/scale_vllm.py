"""The scheduler side of tiercache's vLLM connector with N requests in flight, next to vLLM's own prefix cache.

vLLM 0.33's own ``Scheduler`` drives the connector's scheduler side in one process
(``scale_vllm_parts``: no workers; each step's model output reports
every copy job done, as a CPU worker would, so stores commit). Under the CPU tier
a ``simulated`` remote answers presence after ``PRESENCE_LATENCY_MS`` (a slow
Redis): each request's lookup asks it once and misses, its keys stay in the
presence cache until it ends, and its blocks are stored in the CPU tier and
written through. Per B (blocks of 16 tokens per prompt) the requests in flight
grow through N, a vLLM scheduler without the connector holding the same ones,
and at each N:

- probe (``PROBES`` times after ``WARMUP_PROBES``, medians): one NEW request of B blocks arrives; the
  connector's own time for it (hooks timed on the connector: its
  ``get_num_new_matched_tokens`` calls, the first asking the remote and the one
  answered; ``update_state_after_alloc``; its store job inside
  ``build_connector_meta`` and its commit inside ``update_connector_output``),
  and the step that schedules it (``schedule()`` + ``update_from_output()``) with
  the connector and without; then it is aborted (``finish_us``: its
  ``request_finished``), so N stays N;
- decode: ``DECODE_STEPS`` steps, every request one token a step, each filling
  and storing ``DECODE_STEPS / 16`` blocks: the step with and without the
  connector, the connector's hooks per step, and per request in flight;
- growth: each figure at N over the same at N = 1 (the probe's, and the decode's
  per request).

The reference, per B with the largest N in flight, on request 0's prompt: vLLM's
prefix cache per block, hashing (``get_request_block_hasher``: sha256, the
engine's default, and ``CacheConfig``'s default if another) and a warm lookup
(``KVCacheManager.get_computed_blocks``); tiercache's scheduler side per block on
the same tokens, keys (``RequestKeys.chained``, the connector's ``BlockHasher``)
and a warm ``LowerTiers.lookup`` in the CPU tier (it pins; released untimed);
the ratio tiercache / vLLM. Issue 51's target: at most ``TARGET_RATIO``.

Cells: N in ``REQUESTS`` x B in ``BLOCKS`` but ``SKIPPED``: 1024 x 2048 (2.1 M
blocks in flight; at the ~2.5 KB per block in flight and ~1.3 KB per pool block
measured here, both schedulers, the CPU tier, the presence cache and the tokens
together, about 8 GB, and minutes of fill: past what this shared machine can
spare). 1024 x 512 takes about 2 GB. The background loop (the remote's checks and
write-through puts) shares the GIL with the scheduler, as in vLLM's engine core:
a hook that wakes it waits for it. Run alone (the lead's full run, a few minutes),
in the vLLM venv::

    .venv-vllm/bin/python benchmarks/scale_vllm.py [--quick] [--out PATH]

It prints two tables and writes ``scale_vllm.json`` (with the load average).
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import arguments, parse, write_result
from scale_vllm_parts import BLOCK, SchedulerOnly, Sizes, request
from vllm.config import CacheConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

from tiercache.integrations.vllm.connector.requests import RequestKeys
from tiercache.testing.timed_scheduler import CONNECTOR_HOOKS

REQUESTS = (1, 16, 64, 256, 1024)
BLOCKS = (64, 512, 2048)
SKIPPED = {(2048, 1024): "2.1 M blocks in flight: about 8 GB, past what this shared machine can spare"}
"""(blocks, requests) cells a full run leaves out, and why."""
PROBES = 5
WARMUP_PROBES = 1
"""Probes a cell runs first and drops (the first after a fill meets cold caches and the fill's last puts)."""
DECODE_STEPS = 2 * BLOCK
"""Decode steps measured per cell: every request in flight fills (and stores) exactly two blocks."""
DECODE_ROOM_TOKENS = 1024
"""Tokens a request may decode over a whole run (its ``max_tokens``; vLLM's pool has room for them)."""
FILL_PROMPTS_PER_STEP = 64
"""Prompts a step may prefill while the requests in flight grow (the step's token budget)."""
PRESENCE_LATENCY_MS = 20.0
"""The remote's round trip: a presence check answers a step or more after it was asked."""
LOOKUP_TIMEOUT_MS = 60_000.0
"""The remote lookup's deadline: far past any queue of checks, so no answer is UNKNOWN (which is never kept)."""
VOCAB = 32_000
"""Token ids as wide as a real model's vocabulary (they are hashed, never embedded)."""
PROBE_SEEDS = 1 << 20
"""Probes' prompts are seeded from here on; requests in flight from 0."""
REFERENCE_REPEATS = 7
TARGET_RATIO = 2.0
WAIT_S = 600.0
"""Bound on a fill's steps and on a wait for the remote: a hang detector, never a speed judgement."""
US = 1e6
NS_PER_US = 1e3
MB = 1 << 20
SHARED_MEMORY = "/dev/shm"
"""Where the CPU tier's region lives (the connector's default ``shared_dir``)."""
REQUEST_HOOKS = frozenset({"get_num_new_matched_tokens", "update_state_after_alloc", "get_external_cache_hit_sources",
                           "request_finished", "request_finished_all_groups"})
"""The hooks (of ``CONNECTOR_HOOKS``, those vLLM's scheduler calls) whose first argument is the request."""
GROWTH = ("probe_connector_us", "probe_lookup_first_us", "probe_store_job_us", "decode_connector_us_per_request")
"""The per-request figures whose growth over N = 1 is reported."""
QUICK = {"REQUESTS": (1, 4), "BLOCKS": (16,), "PROBES": 2, "DECODE_STEPS": BLOCK, "REFERENCE_REPEATS": 2,
         "DECODE_ROOM_TOKENS": 256}
"""The constants ``--quick`` replaces."""


class ConnectorClock:
    """The connector's own time: each hook vLLM's scheduler calls, timed on the connector; per request, the hooks
    that take it and, while ``attributing``, its store job and its commit inside the step's hooks."""

    def __init__(self, connector: Any) -> None:
        self.hooks: Counter[str] = Counter()
        """Nanoseconds per hook since ``reset``."""
        self.requests: defaultdict[str, Counter[str]] = defaultdict(Counter)
        """Per request id, nanoseconds per hook or part since ``reset``."""
        self._side = connector._scheduler
        for name in CONNECTOR_HOOKS:
            hook = getattr(connector, name, None)
            if callable(hook):
                setattr(connector, name, self._timed(hook, name, name in REQUEST_HOOKS))

    def _timed(self, method: Callable[..., Any], name: str, keyed: bool) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter_ns() - started
                self.hooks[name] += spent
                if keyed:
                    self.requests[args[0].request_id][name] += spent

        return run

    def _part(self, method: Callable[..., Any], name: str, owner: Callable[[Any], str]) -> Callable[..., Any]:
        def run(item: Any, *args: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return method(item, *args)
            finally:
                self.requests[owner(item)][name] += time.perf_counter_ns() - started

        return run

    @contextlib.contextmanager
    def attributing(self) -> Iterator[None]:
        """Also time each request's store job (in ``build_connector_meta``) and its jobs' ends (in
        ``update_connector_output``)."""
        side = self._side
        side._store_job = self._part(side._store_job, "store_job", lambda state: state.request.request_id)
        side._finish_stores = self._shared(side._finish_stores, "commit")
        try:
            yield
        finally:
            del side._store_job, side._finish_stores

    def _shared(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``method`` ends several requests' store jobs in one call: its time is shared by their blocks."""
        def run(jobs: list[Any]) -> Any:
            started = time.perf_counter_ns()
            try:
                return method(jobs)
            finally:
                spent, blocks = time.perf_counter_ns() - started, sum(len(job.keys) for job in jobs)
                for job in jobs:
                    self.requests[job.request.request_id][name] += spent * len(job.keys) // max(blocks, 1)

        return run

    def reset(self) -> None:
        self.hooks.clear()
        self.requests.clear()


def prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of token ids, the same for one seed."""
    return np.random.default_rng(seed).integers(0, VOCAB, blocks * BLOCK).tolist()


def topology(slots: int) -> dict[str, Any]:
    """The connector's tiers: a CPU tier of ``slots`` blocks over the slow remote (write-through, the default)."""
    remote = {"type": "simulated", "name": "remote", "options": {"latency_ms": PRESENCE_LATENCY_MS}}
    return {"tiers": [{"type": "cpu", "capacity_blocks": slots}, remote],
            "queues": {"remote_lookup_timeout_ms": LOOKUP_TIMEOUT_MS}}


def build(root: Path, blocks: int, most: int) -> tuple[SchedulerOnly, SchedulerOnly]:
    """The connector's instance and vLLM's alone, sized for ``most`` requests in flight (and a probe)."""
    per_request = blocks + DECODE_ROOM_TOKENS // BLOCK + 1
    sizes = Sizes(num_blocks=(most + 1) * per_request, max_num_seqs=most + 1,
                  max_num_batched_tokens=min(FILL_PROMPTS_PER_STEP, most + 1) * blocks * BLOCK + most + 1,
                  max_model_len=blocks * BLOCK + DECODE_ROOM_TOKENS)
    slots = sizes.num_blocks + (WARMUP_PROBES + PROBES) * len(REQUESTS) * blocks
    return (SchedulerOnly(root / "tiercache", f"scale-{blocks}", sizes, topology(slots)),
            SchedulerOnly(root / "vllm", f"alone-{blocks}", sizes))


def grow(pair: tuple[SchedulerOnly, SchedulerOnly], target: int, blocks: int) -> None:
    """Add requests until ``target`` are running in both schedulers (prefilled; untimed)."""
    running = len(pair[0].scheduler.running)
    for index in range(running, target):
        tokens = prompt(index, blocks)
        for side in pair:
            side.add(request(f"r{index}", tokens, DECODE_ROOM_TOKENS))
    for side in pair:
        deadline = time.monotonic() + WAIT_S
        while side.scheduler.waiting or len(side.scheduler.running) < target:
            assert time.monotonic() < deadline, f"{target} requests never ran"
            side.step()
            if side.connector is not None and side.scheduler.waiting:
                side.tiers.wait_for_answers(WAIT_S)


def probe(pair: tuple[SchedulerOnly, SchedulerOnly], clock: ConnectorClock, seed: int, blocks: int) -> dict[str, float]:
    """One new request's arrival at both schedulers, then its abort (µs; see the module docstring)."""
    tiercache, alone = pair
    req_id, tokens = f"probe-{seed}", prompt(PROBE_SEEDS + seed, blocks)
    for side in pair:
        side.add(request(req_id, tokens, DECODE_ROOM_TOKENS))
    clock.reset()
    with clock.attributing():
        first = tiercache.step()
        asked = clock.requests[req_id]["get_num_new_matched_tokens"]
        assert req_id not in first.output.num_scheduled_tokens, "the first lookup was answered at once"
        tiercache.tiers.wait_for_answers(WAIT_S)
        arrival = tiercache.step()
    assert arrival.output.num_scheduled_tokens.get(req_id) == len(tokens), "the probe was not scheduled whole"
    scheduled = alone.step()
    assert scheduled.output.num_scheduled_tokens.get(req_id) == len(tokens)
    spent = dict(clock.requests[req_id])
    clock.reset()
    for side in pair:
        side.finish([req_id])
    parts = {"lookup_first": asked, "lookup_answered": spent["get_num_new_matched_tokens"] - asked,
             "alloc": spent.get("update_state_after_alloc", 0), "store_job": spent.get("store_job", 0),
             "commit": spent.get("commit", 0)}
    figures = {f"probe_{name}_us": ns / NS_PER_US for name, ns in parts.items()}
    figures["probe_connector_us"] = sum(parts.values()) / NS_PER_US
    figures["probe_connector_us_per_block"] = figures["probe_connector_us"] / blocks
    figures["probe_finish_us"] = sum(clock.requests[req_id].values()) / NS_PER_US
    figures["first_step_us"] = (first.schedule_s + first.update_s) * US
    figures["arrival_schedule_us"], figures["arrival_update_us"] = arrival.schedule_s * US, arrival.update_s * US
    figures["arrival_schedule_vllm_us"], figures["arrival_update_vllm_us"] = (scheduled.schedule_s * US,
                                                                              scheduled.update_s * US)
    return figures


def decode(pair: tuple[SchedulerOnly, SchedulerOnly], clock: ConnectorClock, requests: int) -> dict[str, Any]:
    """``DECODE_STEPS`` steps of both schedulers, interleaved: per step means (µs)."""
    times: dict[str, float] = Counter()
    stored = pair[0].tiers.stats()["tiers"]["cpu"]["blocks_in"]
    clock.reset()
    for _ in range(DECODE_STEPS):
        for side, suffix in zip(pair, ("", "_vllm"), strict=True):
            step = side.step()
            assert step.output.total_num_scheduled_tokens == requests, "a request in flight was not decoded"
            times[f"decode_schedule{suffix}_us"] += step.schedule_s * US / DECODE_STEPS
            times[f"decode_update{suffix}_us"] += step.update_s * US / DECODE_STEPS
    hooks = {name: ns / NS_PER_US / DECODE_STEPS for name, ns in sorted(clock.hooks.items())}
    connector = sum(hooks.values())
    stored = pair[0].tiers.stats()["tiers"]["cpu"]["blocks_in"] - stored
    return {**times, "decode_connector_us": connector, "decode_connector_us_per_request": connector / requests,
            "decode_hooks_us": hooks, "decode_stored_blocks_per_step": stored / DECODE_STEPS}


def cell(pair: tuple[SchedulerOnly, SchedulerOnly], clock: ConnectorClock, requests: int, blocks: int,
         earlier_probes: int) -> dict[str, Any]:
    """One N x B cell: grow to ``requests`` in flight, probe, decode; check that no key was asked twice (every
    request's kept while it runs, ``earlier_probes`` of this B's earlier cells too)."""
    started = time.monotonic()
    grow(pair, requests, blocks)
    filled = time.monotonic() - started
    runs = WARMUP_PROBES + PROBES
    probes = [probe(pair, clock, requests * runs + index, blocks) for index in range(runs)][WARMUP_PROBES:]
    row: dict[str, Any] = {"blocks": blocks, "requests": requests, "fill_s": filled}
    row.update({name: statistics.median(p[name] for p in probes) for name in probes[0]})
    row.update(decode(pair, clock, requests))
    row["presence_keys_asked"] = pair[0].tiers.parts.remotes[0].keys_requested["contains"]
    looked_up = blocks - 1  # vLLM leaves a prompt's last token to compute: its last block is never loaded
    asked = (requests + earlier_probes + runs) * looked_up
    assert row["presence_keys_asked"] == asked, f"keys asked again: {row['presence_keys_asked']} for {asked}"
    row["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
    return row


def reference(pair: tuple[SchedulerOnly, SchedulerOnly], blocks: int, row: dict[str, Any]) -> dict[str, Any]:
    """Per block, µs (fastest of ``REFERENCE_REPEATS``, interleaved): vLLM's hashing and warm lookup, tiercache's
    keys and warm CPU-tier lookup, on request 0's prompt (held by both); beside them, ``row``'s (the largest N's)
    whole connector time for a new request, per block."""
    tiercache, alone = pair
    tokens = [*prompt(0, blocks), 0]  # one token more: vLLM's lookup leaves the last token to compute
    algos = dict.fromkeys(("sha256", CacheConfig().prefix_caching_hash_algo))
    hashers = {algo: get_request_block_hasher(BLOCK, get_hash_fn_by_name(algo)) for algo in algos}
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    tiers = tiercache.tiers
    for _ in range(REFERENCE_REPEATS):
        fresh = request("reference", tokens, 1)  # hashed by vLLM's hasher as it is made (untimed)
        hashed = list(fresh.block_hashes)
        for algo, hasher in hashers.items():
            fresh.block_hashes.clear()
            started = time.perf_counter()
            hashes = hasher(fresh)
            best[f"hash:{algo}"] = min(best[f"hash:{algo}"], time.perf_counter() - started)
            assert len(hashes) == blocks
        fresh.block_hashes[:] = hashed
        started = time.perf_counter()
        _, hit_tokens, _ = alone.scheduler.kv_cache_manager.get_computed_blocks(fresh)
        best["vllm_lookup"] = min(best["vllm_lookup"], time.perf_counter() - started)
        assert hit_tokens == blocks * BLOCK, f"vLLM's cache holds {hit_tokens} of request 0's {blocks * BLOCK} tokens"
        started = time.perf_counter()
        keys = RequestKeys(fresh, None).chained(tiers.hasher, blocks)
        best["keys"] = min(best["keys"], time.perf_counter() - started)
        started = time.perf_counter()
        hit = tiers.lookup(keys)
        best["lookup"] = min(best["lookup"], time.perf_counter() - started)
        assert hit is not None and hit.num_blocks == blocks, "the CPU tier does not hold request 0's blocks"
        tiers.release(hit)
    per_block = {name: seconds * US / blocks for name, seconds in best.items()}
    vllm = per_block["hash:sha256"] + per_block["vllm_lookup"]
    ours = per_block["keys"] + per_block["lookup"]
    return {"blocks": blocks, "vllm_hash_us_per_block": {algo: per_block[f"hash:{algo}"] for algo in algos},
            "vllm_lookup_us_per_block": per_block["vllm_lookup"], "tiercache_keys_us_per_block": per_block["keys"],
            "tiercache_lookup_us_per_block": per_block["lookup"], "vllm_us_per_block": vllm,
            "tiercache_us_per_block": ours, "keys_vs_hash": per_block["keys"] / per_block["hash:sha256"],
            "lookup_vs_lookup": per_block["lookup"] / per_block["vllm_lookup"], "ratio": ours / vllm,
            "meets_target": ours / vllm <= TARGET_RATIO, "new_request_requests": row["requests"],
            "new_request_us_per_block": row["probe_connector_us_per_block"]}


def with_growth(rows: list[dict[str, Any]]) -> None:
    """Each row's ``GROWTH`` figures over the same figure in the row of its B with the fewest requests."""
    for row in rows:
        base = min((r for r in rows if r["blocks"] == row["blocks"]), key=lambda r: r["requests"])
        row["growth_base_requests"] = base["requests"]
        row["growth"] = {name: row[name] / base[name] for name in GROWTH}


def tables(rows: list[dict[str, Any]], references: list[dict[str, Any]]) -> str:
    lines = ["in flight (µs; growth: over N=1)",
             f"{'B':>5}{'N':>6}{'probe tc':>10}{'growth':>8}{'1st lookup':>11}{'store job':>10}{'arrive tc':>10}"
             f"{'vllm':>8}{'decode tc':>10}{'vllm':>8}{'tc/step':>9}{'tc/req':>8}{'growth':>8}"]
    for row in rows:
        growth = row["growth"]
        lines.append(
            f"{row['blocks']:>5}{row['requests']:>6}{row['probe_connector_us']:>10.0f}"
            f"{growth['probe_connector_us']:>8.2f}{row['probe_lookup_first_us']:>11.0f}{row['probe_store_job_us']:>10.0f}"
            f"{row['arrival_schedule_us'] + row['arrival_update_us']:>10.0f}"
            f"{row['arrival_schedule_vllm_us'] + row['arrival_update_vllm_us']:>8.0f}"
            f"{row['decode_schedule_us'] + row['decode_update_us']:>10.0f}"
            f"{row['decode_schedule_vllm_us'] + row['decode_update_vllm_us']:>8.0f}{row['decode_connector_us']:>9.0f}"
            f"{row['decode_connector_us_per_request']:>8.2f}{growth['decode_connector_us_per_request']:>8.2f}"
        )
    lines += ["", "per block (µs): vLLM's prefix cache vs tiercache's scheduler side",
              f"{'B':>5}{'vllm hash':>10}{'lookup':>8}{'tc keys':>9}{'lookup':>8}{'ratio':>7}{'target':>7}"
              f"{'new request tc':>16}"]
    for ref in references:
        lines.append(
            f"{ref['blocks']:>5}{ref['vllm_hash_us_per_block']['sha256']:>10.2f}{ref['vllm_lookup_us_per_block']:>8.2f}"
            f"{ref['tiercache_keys_us_per_block']:>9.2f}{ref['tiercache_lookup_us_per_block']:>8.2f}"
            f"{ref['ratio']:>7.2f}{'yes' if ref['meets_target'] else 'NO':>7}{ref['new_request_us_per_block']:>16.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(arguments(__doc__.splitlines()[0]), argv)
    if args.quick:
        globals().update(QUICK)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    references = []
    shared = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
    with tempfile.TemporaryDirectory(prefix="scale-vllm-", dir=shared) as root:
        for blocks in BLOCKS:
            counts = [n for n in REQUESTS if (blocks, n) not in SKIPPED]
            pair = build(Path(root) / str(blocks), blocks, max(counts))
            clock = ConnectorClock(pair[0].connector)
            try:
                runs = WARMUP_PROBES + PROBES
                rows += [cell(pair, clock, n, blocks, runs * index) for index, n in enumerate(counts)]
                references.append(reference(pair, blocks, rows[-1]))
            finally:
                for side in pair:
                    side.shutdown()
    with_growth(rows)
    load_after = os.getloadavg()
    print(tables(rows, references))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    result = {"rows": rows, "reference": references, "skipped": [{"blocks": b, "requests": n, "why": why}
                                                                for (b, n), why in SKIPPED.items()],
              "presence_latency_ms": PRESENCE_LATENCY_MS, "block_size": BLOCK, "decode_steps": DECODE_STEPS,
              "probes": PROBES,
              "loadavg_before": load_before, "loadavg_after": load_after}
    path = write_result(__file__, result, args.out, args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
