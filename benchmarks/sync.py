"""The regional tier's reads against the Redis tier's GET on the same redis-server.

Central and two regions run on loopback (tiercache.testing.redis_servers). Region A holds
current copies of every key, and the same server holds the same blocks written
by a Redis tier (its own key prefix). The ceiling is that Redis tier's GET of a
batch; measured in the same run, taking turns batch by batch: a plain regional read of the same batch (the
region's GETs), a force_latest read (adds central's version check), and a
force_latest read after region B rewrote every key (each read also fetches from
central and refreshes region A). ``RUNS`` repetitions in the one process; every
row reports the median over the runs of each run's p50 (and mean and p95).

    python benchmarks/sync.py [--quick] [--out PATH]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from common import arguments, parse, write_result

from tiercache.blocks.codec import Codec
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.redis import RedisOptions, RedisTier
from tiercache.tiers.regional import RegionalOptions, RegionalTier, SyncMode

BLOCK_BYTES = 64 * 1024
BATCH = 32
KEYS = 512
ROUNDS = 60
RUNS = 3
PERCENTILES = (50, 95)
MS = 1000.0
FINGERPRINT = bytes(16)
CEILING = "redis tier GET (ceiling)"
QUICK = {"KEYS": 64, "ROUNDS": 4, "RUNS": 1}
"""The constants ``--quick`` replaces."""

Read = Callable[[Sequence[bytes], Sequence[memoryview]], Awaitable[list[bool]]]


async def make_tier(central: RedisServer, region: RedisServer) -> RegionalTier:
    options = RegionalOptions(
        central_url=central.url, region_url=region.url, mode=SyncMode.REGIONAL, invalidate=False
    )
    tier = RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BLOCK_BYTES), options)
    await tier.start()
    return tier


async def timed_reads(reads: dict[str, Read], keys: list[bytes], rounds: int) -> dict[str, list[float]]:
    """Each read's latency per batch in ms; the reads take turns batch by batch (a noisy moment hits all)."""
    dests = [memoryview(bytearray(BLOCK_BYTES)) for _ in range(BATCH)]
    samples: dict[str, list[float]] = {name: [] for name in reads}
    for r in range(rounds):
        batch = keys[(r * BATCH) % len(keys) :][:BATCH]
        for name, read in reads.items():
            started = time.perf_counter()
            oks = await read(batch, dests[: len(batch)])
            samples[name].append((time.perf_counter() - started) * MS)
            if not all(oks):
                raise RuntimeError(f"benchmark read missed: {name}")
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    cuts = np.percentile(samples, PERCENTILES)
    tails = {f"p{p}_ms": float(c) for p, c in zip(PERCENTILES, cuts, strict=True)}
    return {"mean_ms": statistics.fmean(samples), **tails}


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs."""
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


async def run(central: RedisServer, region_a: RedisServer, region_b: RedisServer) -> dict[str, Any]:
    a = await make_tier(central, region_a)
    b = await make_tier(central, region_b)
    redis = RedisTier(RemoteContext("redis", Codec(FINGERPRINT), BLOCK_BYTES), RedisOptions(url=region_a.url))
    await redis.start()
    keys = [i.to_bytes(16, "little") for i in range(KEYS)]
    payloads = [memoryview(bytes([i % 256]) * BLOCK_BYTES) for i in range(KEYS)]
    for start in range(0, KEYS, BATCH):
        await a.put(keys[start : start + BATCH], payloads[start : start + BATCH])
        await redis.put(keys[start : start + BATCH], payloads[start : start + BATCH])
    await a.flush()

    async def plain(batch: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]:
        return await a.get_into(batch, dests)

    async def latest(batch: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]:
        return await a.get_into(batch, dests, force_latest=True)

    reads: dict[str, Read] = {
        CEILING: redis.get_into, "regional plain read": plain, "force_latest, region current": latest
    }
    await timed_reads(reads, keys, ROUNDS // 4)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in reads}
    for _ in range(RUNS):
        for name, samples in (await timed_reads(reads, keys, ROUNDS)).items():
            runs[name].append(summary(samples))
    rows = {name: median_of(figures) for name, figures in runs.items()}
    for start in range(0, KEYS, BATCH):
        await b.put(keys[start : start + BATCH], payloads[start : start + BATCH])
    await b.flush()
    stale = await timed_reads({"stale": latest}, keys, KEYS // BATCH)
    rows["force_latest, region stale"] = summary(stale["stale"])
    stats = a.stats()
    for tier in (a, b, redis):
        await tier.close()
    return {"rows": rows, "runs": runs, "refreshed": stats["refreshed"]}


def main() -> None:
    args = parse(arguments(__doc__.splitlines()[0]))
    if args.quick:
        globals().update(QUICK)
    servers = [RedisServer().start() for _ in range(3)]
    try:
        result = asyncio.run(run(*servers))
    finally:
        for server in servers:
            server.close()
    rows = result["rows"]
    ceiling = rows[CEILING]["p50_ms"]
    print(f"batches of {BATCH} x {BLOCK_BYTES // 1024} KiB, loopback redis-servers, median of {RUNS} runs")
    print(f"{'read':<34}{'mean ms':>9}{'p50 ms':>9}{'p95 ms':>9}{'p50 / ceiling':>15}")
    for name, row in rows.items():
        ratio = row["p50_ms"] / ceiling
        print(f"{name:<34}{row['mean_ms']:>9.2f}{row['p50_ms']:>9.2f}{row['p95_ms']:>9.2f}{ratio:>15.2f}")
    result.update({"batch": BATCH, "block_bytes": BLOCK_BYTES, "runs_count": RUNS})
    print(f"wrote {write_result(__file__, result, args.out, args.quick)}")


if __name__ == "__main__":
    main()
