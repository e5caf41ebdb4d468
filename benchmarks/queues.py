"""Transfer-queue costs on a simulated engine: step-time overhead of in-flight stores, load latency under a storm.

1. A step loop (a fixed single-threaded matmul per step, like a decode step)
   that also hands the manager a freshly computed prompt to store every step;
   the stores go GPU pool -> CPU -> a simulated remote in the background. The
   ceiling is the same loop with no stores, measured in the same run; target:
   at most 3% more step time.
2. Load latency percentiles from a simulated remote while a storm of stores
   competes for the same tier, against the same loads alone (same run).

    python benchmarks/queues.py [--quick] [--out PATH]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np
import torch
from common import arguments, parse, write_result

from tiercache.config import config_from_dict
from tiercache.manager.tier_manager import CapacityError, TierManager

LAYOUT = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": 16}
STEPS = 150
STEP_MATRICES = (384, 768)
"""A short (~3 ms) and a decode-like (~25 ms) step on this CPU stand-in."""
STORE_BLOCKS_PER_STEP = 4
LOADS = 200
LOAD_BLOCKS = 8
STORM_PROMPTS = 400
STORM_BLOCKS = 8
PERCENTILES = (50, 95, 99)
OVERHEAD_TARGET = 0.03
MS = 1000.0
SIM = {"latency_ms": 1.0, "jitter_ms": 0.5, "bandwidth_mb_s": 2000.0, "seed": 1}
QUICK = {"STEPS": 4, "STEP_MATRICES": (64,), "LOADS": 8, "STORM_PROMPTS": 16}
"""The constants ``--quick`` replaces."""


def manager(gpu_blocks: int, cpu_blocks: int, **queues: Any) -> TierManager:
    tiers = [
        {"type": "gpu", "capacity_blocks": gpu_blocks, "options": {"device": "cpu"}},
        {"type": "cpu", "capacity_blocks": cpu_blocks},
        {"type": "simulated", "name": "sim", "options": SIM},
    ]
    data = {"model": {"id": "bench"}, "layout": LAYOUT, "tiers": tiers, "queues": queues}
    return TierManager(config_from_dict(data, environ={}))


def step_loop(mgr: TierManager | None, size: int) -> list[float]:
    """Per-step seconds of a matmul step that (with a manager) stores a new prompt each step."""
    a = torch.randn(size, size)
    times = []
    block = LAYOUT["block_size"]
    for step in range(STEPS):
        started = time.perf_counter()
        for _ in range(4):
            a = torch.tanh(a @ a)
        if mgr is not None:
            tokens = np.arange(STORE_BLOCKS_PER_STEP * block) + step * 1_000_000
            ids = mgr.allocate(STORE_BLOCKS_PER_STEP)
            mgr.store(tokens, ids)
            mgr.release(ids)
            mgr.poll()
        times.append(time.perf_counter() - started)
    return times


def overhead(size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    step_loop(None, size)
    base = step_loop(None, size)
    with manager(256, 2048, max_pending_stores=4096) as mgr:
        loaded = step_loop(mgr, size)
        stats = mgr.stats()
    base_ms, with_ms = statistics.median(base) * MS, statistics.median(loaded) * MS
    return {
        "steps": STEPS,
        "matrix": size,
        "step_ms_without_stores": base_ms,
        "step_ms_with_stores": with_ms,
        "overhead": with_ms / base_ms - 1.0,
        "target": OVERHEAD_TARGET,
        "blocks_written_remote": stats["tiers"].get("sim", {}).get("blocks_in", 0),
        "stores_dropped": stats["tiers"].get("sim", {}).get("stores_dropped", 0),
    }


async def load_latencies(storm: bool) -> dict[str, Any]:
    block = LAYOUT["block_size"]
    mgr = manager(1024, 8192, transfer_concurrency=8, max_pending_stores=512)
    async with mgr:
        sim = mgr.parts.remotes[0]
        prompts = [np.arange(LOAD_BLOCKS * block) + (i + 1) * 10_000_000 for i in range(LOADS)]
        for tokens in prompts:
            for key in mgr.hasher.keys(tokens):
                sim.store.save(key, sim.codec.encode_value(key, bytes(mgr.layout.bytes_per_block)))

        async def stores() -> None:
            for i in range(STORM_PROMPTS):
                tokens = np.arange(STORM_BLOCKS * block) + i * 1000
                try:
                    ids = mgr.allocate(STORM_BLOCKS)
                except CapacityError:
                    await asyncio.sleep(0)
                    continue
                mgr.store(tokens, ids)
                mgr.release(ids)
                await asyncio.sleep(0)

        storm_task = asyncio.ensure_future(stores()) if storm else None
        latencies = []
        for tokens in prompts:
            hit = mgr.lookup(tokens)
            while hit.pending:
                await asyncio.sleep(0)
                hit = mgr.lookup(tokens)
            ids = mgr.allocate(hit.num_lower_blocks)
            started = time.perf_counter()
            await mgr.load(hit, ids)
            latencies.append((time.perf_counter() - started) * MS)
            mgr.release(ids)
        if storm_task is not None:
            await storm_task
        stats = mgr.stats()["tiers"]["sim"]
    cuts = np.percentile(latencies, PERCENTILES)
    return {
        **{f"p{p}_ms": float(v) for p, v in zip(PERCENTILES, cuts, strict=True)},
        "stores_dropped": stats.get("stores_dropped", 0),
        "put_calls": stats.get("store", {}).get("put_calls", 0),
    }


def main() -> None:
    args = parse(arguments(__doc__.splitlines()[0]))
    if args.quick:
        globals().update(QUICK)
    steps = [overhead(size) for size in STEP_MATRICES]
    alone = asyncio.run(load_latencies(storm=False))
    stormy = asyncio.run(load_latencies(storm=True))
    print(f"{'step loop, 4 blocks stored/step':<34}{'no stores (ceiling)':>20}{'with stores':>12}{'overhead':>10}")
    for step in steps:
        label = f"  matmul {step['matrix']}"
        print(
            f"{label:<34}{step['step_ms_without_stores']:>17.3f} ms"
            f"{step['step_ms_with_stores']:>9.3f} ms{step['overhead'] * 100:>+9.2f}%"
        )
    print(f"  target: overhead <= {OVERHEAD_TARGET * 100:.0f}%")
    print(f"\n{'loads of 8 blocks':<28}" + "".join(f"{f'p{p} ms':>10}" for p in PERCENTILES))
    for name, row in (("alone (ceiling)", alone), ("under a store storm", stormy)):
        print(f"{'  ' + name:<28}" + "".join(f"{row[f'p{p}_ms']:>10.2f}" for p in PERCENTILES))
    print(f"  storm: {stormy['put_calls']} put calls, {stormy['stores_dropped']} blocks dropped by back-pressure")
    result = {
        "simulated_remote": SIM,
        "layout": LAYOUT,
        "step_overhead": steps,
        "loads_alone": alone,
        "loads_under_storm": stormy,
    }
    print(f"wrote {write_result(__file__, result, args.out, args.quick)}")


if __name__ == "__main__":
    main()
