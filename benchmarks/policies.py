"""Eviction policies: miss ratios against libCacheSim and Belady, and decisions per second.

For each trace of tiercache.testing.policy_traces and three cache sizes (fractions of the
trace's distinct keys), it replays the trace through each of our policies (the
loop of policies/base.py), through libCacheSim's C simulator (the same policy,
Belady's OPT) and through cachetools.LRUCache, all in this one run. It prints a
miss-ratio table, a speed table (million decisions per second: requests
replayed, hit or miss, fastest of ``--repeat`` interleaved rounds) and the targets of issue 3,
and writes everything to policies.json next to this script.

    python benchmarks/policies.py [--requests 400000] [--repeat 5] [--quick] [--out PATH]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cachetools
import libcachesim as lcs
from common import arguments, parse, result_path

from tiercache.policies import keyed_policy
from tiercache.testing.policy_traces import TRACES, Trace, write_oracle_general

POLICY_NAMES = ("lru", "arc", "s3fifo", "twoq")
SIZE_FRACTIONS = (0.01, 0.05, 0.2)
"""Cache sizes as fractions of a trace's distinct keys."""
MIN_CACHE_SIZE = 20
"""libCacheSim's S3FIFO admits nothing below this (its small FIFO would hold <= 1 object)."""
HASHPOWER = 18
"""libCacheSim's initial hash table (2**18 buckets): big enough not to resize, cheap to allocate."""

LIBCACHESIM: dict[str, Callable[[int], lcs.CacheBase]] = {
    "lru": lambda c: lcs.LRU(c, hashpower=HASHPOWER),
    "arc": lambda c: lcs.ARC(c, hashpower=HASHPOWER),
    "s3fifo": lambda c: lcs.S3FIFO(c, hashpower=HASHPOWER),
    "twoq": lambda c: lcs.TwoQ(c, hashpower=HASHPOWER),
    "belady": lambda c: lcs.Belady(c, hashpower=HASHPOWER),
}

TARGET_DECISIONS_PER_S = 1e6
TARGET_LRU_SPEEDUP = 2.0
TARGET_SCAN_GAIN = 0.05
"""Hit-ratio points S3-FIFO and ARC must gain over LRU on the scan trace at the smallest size."""
SCAN_TRACE = "zipf_scan"
MILLION = 1e6
QUICK_ARGUMENTS = {"requests": 2_000, "repeat": 1}
"""The defaults ``--quick`` gives the options."""


def replay(policy_name: str, trace: Trace, size: int) -> tuple[float, float]:
    """Miss ratio and seconds of one replay of ``trace`` through our policy."""
    policy = keyed_policy(policy_name, size)
    access, evict, insert = policy.access, policy.evict, policy.insert
    misses = 0
    start = time.perf_counter()
    for key in trace:
        if not access(key):
            misses += 1
            while len(policy) >= size:
                evict(incoming=key)
            insert(key)
    return misses / len(trace), time.perf_counter() - start


def replay_cachetools(trace: Trace, size: int) -> tuple[float, float]:
    """Miss ratio and seconds of one replay through cachetools.LRUCache (its fastest idiom)."""
    cache: cachetools.LRUCache[int, None] = cachetools.LRUCache(size)
    misses = 0
    start = time.perf_counter()
    for key in trace:
        if key in cache:
            cache[key]  # a read is what moves the key to the MRU end
        else:
            misses += 1
            cache[key] = None
    elapsed = time.perf_counter() - start
    return misses / len(trace), elapsed


def replay_libcachesim(name: str, path: Path, size: int) -> tuple[float, float]:
    """Miss ratio and seconds of libCacheSim's C loop over the oracleGeneral file."""
    cache = LIBCACHESIM[name](size)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    start = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    return miss_ratio, time.perf_counter() - start


def measure(trace: Trace, path: Path, size: int, repeat: int) -> dict[str, Any]:
    """Miss ratios and decisions per second at one cache size.

    The runs are interleaved (each round runs every implementation once) and the
    fastest round of each is kept, so load from other processes on this shared
    machine weighs on all of them alike.
    """
    n = len(trace)
    runs: dict[str, Callable[[], tuple[float, float]]] = {
        name: (lambda name=name: replay(name, trace, size)) for name in POLICY_NAMES
    }
    runs["cachetools_lru"] = lambda: replay_cachetools(trace, size)
    for name in LIBCACHESIM:
        runs[f"libcachesim_{name}"] = lambda name=name: replay_libcachesim(name, path, size)
    miss_ratio: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for _ in range(repeat):
        for label, run in runs.items():
            miss_ratio[label], elapsed = run()
            seconds[label] = min(elapsed, seconds.get(label, elapsed))
    ours = {name: miss_ratio[name] for name in POLICY_NAMES}
    theirs = {name: miss_ratio[f"libcachesim_{name}"] for name in POLICY_NAMES}
    return {
        "size": size,
        "miss_ratio": {
            "ours": ours,
            "libcachesim": theirs,
            "belady": miss_ratio["libcachesim_belady"],
            "cachetools_lru": miss_ratio["cachetools_lru"],
        },
        "max_abs_diff_vs_libcachesim": max(abs(ours[name] - theirs[name]) for name in POLICY_NAMES),
        "decisions_per_s": {
            "ours": {name: n / seconds[name] for name in POLICY_NAMES},
            "cachetools_lru": n / seconds["cachetools_lru"],
            "libcachesim": {name: n / seconds[f"libcachesim_{name}"] for name in POLICY_NAMES},
        },
    }


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the numbers it was judged on."""
    rows = [row for trace in results.values() for row in trace["sizes"]]
    slowest = {name: min(row["decisions_per_s"]["ours"][name] for row in rows) for name in POLICY_NAMES}
    speedups = [row["decisions_per_s"]["ours"]["lru"] / row["decisions_per_s"]["cachetools_lru"] for row in rows]
    smallest = results[SCAN_TRACE]["sizes"][0]["miss_ratio"]["ours"]
    gains = {name: smallest["lru"] - smallest[name] for name in ("s3fifo", "arc")}
    return {
        "every_policy_decisions_per_s_min": slowest,
        "every_policy_at_least_1M": all(v >= TARGET_DECISIONS_PER_S for v in slowest.values()),
        "lru_speedup_vs_cachetools_min": min(speedups),
        "lru_at_least_2x_cachetools": min(speedups) >= TARGET_LRU_SPEEDUP,
        "scan_hit_ratio_gain_over_lru_smallest_size": gains,
        "s3fifo_and_arc_gain_at_least_5pp": all(g >= TARGET_SCAN_GAIN for g in gains.values()),
        "exact_vs_libcachesim": all(row["max_abs_diff_vs_libcachesim"] <= 1e-9 for row in rows),
    }


def print_tables(results: dict[str, Any], goals: dict[str, Any]) -> None:
    header = f"{'trace':10} {'size':>6} {'belady':>7}" + "".join(f" {n:>7}" for n in POLICY_NAMES)
    print("Miss ratios (ours; libCacheSim's are identical where 'vs lcs' is 0)")
    print(header + f" {'vs lcs':>8}")
    for trace_name, trace in results.items():
        for row in trace["sizes"]:
            ratios = row["miss_ratio"]
            line = f"{trace_name:10} {row['size']:>6} {ratios['belady']:>7.4f}"
            line += "".join(f" {ratios['ours'][n]:>7.4f}" for n in POLICY_NAMES)
            print(line + f" {row['max_abs_diff_vs_libcachesim']:>8.1e}")
    print()
    print("Million decisions per second (best of repeats)")
    lcs_names = [f"lcs-{n}" for n in POLICY_NAMES]
    print(
        f"{'trace':10} {'size':>6}"
        + "".join(f" {n:>7}" for n in POLICY_NAMES)
        + f" {'ct-lru':>7}"
        + "".join(f" {n:>10}" for n in lcs_names)
    )
    for trace_name, trace in results.items():
        for row in trace["sizes"]:
            speed = row["decisions_per_s"]
            line = f"{trace_name:10} {row['size']:>6}"
            line += "".join(f" {speed['ours'][n] / MILLION:>7.2f}" for n in POLICY_NAMES)
            line += f" {speed['cachetools_lru'] / MILLION:>7.2f}"
            line += "".join(f" {speed['libcachesim'][n] / MILLION:>10.2f}" for n in POLICY_NAMES)
            print(line)
    print()
    print("Targets")
    for key, value in goals.items():
        print(f"  {key}: {value}")


def machine() -> dict[str, Any]:
    """Where the numbers come from; the load average shows how shared the CPUs were."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "libcachesim": getattr(lcs, "__version__", "unknown"),
        "cachetools": cachetools.__version__,
        "load_average_1_5_15_min": os.getloadavg(),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400_000, help="requests per trace")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds (fastest kept)")
    parser.add_argument("--output", dest="out", type=Path, help="the same as --out")
    args = parse(parser, argv, **QUICK_ARGUMENTS)

    machine_before = machine()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        for trace_name, generate in TRACES.items():
            trace = generate(args.requests)
            path = write_oracle_general(trace, Path(directory) / f"{trace_name}.bin")
            distinct = len(set(trace))
            sizes = [max(MIN_CACHE_SIZE, int(distinct * f)) for f in SIZE_FRACTIONS]
            results[trace_name] = {
                "requests": len(trace),
                "distinct_keys": distinct,
                "sizes": [measure(trace, path, size, args.repeat) for size in sizes],
            }
    goals = targets(results)
    print_tables(results, goals)
    report = {
        "machine": machine_before,
        "quick": args.quick,
        "load_average_after": os.getloadavg(),
        "requests_per_trace": args.requests,
        "repeat": args.repeat,
        "size_fractions": SIZE_FRACTIONS,
        "traces": results,
        "targets": goals,
    }
    path = result_path(__file__, args.out)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
