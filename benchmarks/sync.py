"""force_latest's extra cost over a plain regional read, on three local redis-servers.

Central and two regions run on loopback (tests/redis_servers.py). Region A holds
current copies of every key; a plain read is one MGET from the region, a
force_latest read adds central's version check (one MGET of version keys). A
third row reads force_latest after region B rewrote every key, so each read also
fetches from central and refreshes region A. The ceiling is the plain regional
read of the same batch, measured in the same run.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import write_result
from redis_servers import RedisServer

from tiercache.codec import Codec
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier, SyncMode

BLOCK_BYTES = 64 * 1024
BATCH = 32
KEYS = 512
ROUNDS = 60
PERCENTILES = (50, 95)
MS = 1000.0
FINGERPRINT = bytes(16)


async def make_tier(central: RedisServer, region: RedisServer) -> RegionalTier:
    options = RegionalOptions(
        central_url=central.url, region_url=region.url, mode=SyncMode.REGIONAL, invalidate=False
    )
    tier = RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BLOCK_BYTES), options)
    await tier.start()
    return tier


async def timed_reads(tier: RegionalTier, keys: list[bytes], force_latest: bool, rounds: int) -> list[float]:
    dests = [memoryview(bytearray(BLOCK_BYTES)) for _ in range(BATCH)]
    samples = []
    for r in range(rounds):
        batch = keys[(r * BATCH) % len(keys) :][:BATCH]
        started = time.perf_counter()
        oks = await tier.get_into(batch, dests[: len(batch)], force_latest=force_latest)
        samples.append((time.perf_counter() - started) * MS)
        if not all(oks):
            raise RuntimeError("benchmark read missed")
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    cuts = np.percentile(samples, PERCENTILES)
    tails = {f"p{p}_ms": float(c) for p, c in zip(PERCENTILES, cuts, strict=True)}
    return {"mean_ms": statistics.fmean(samples), **tails}


async def run(central: RedisServer, region_a: RedisServer, region_b: RedisServer) -> dict[str, Any]:
    a = await make_tier(central, region_a)
    b = await make_tier(central, region_b)
    keys = [i.to_bytes(16, "little") for i in range(KEYS)]
    payloads = [memoryview(bytes([i % 256]) * BLOCK_BYTES) for i in range(KEYS)]
    for start in range(0, KEYS, BATCH):
        await a.put(keys[start : start + BATCH], payloads[start : start + BATCH])
    await a.flush()
    rows = {}
    await timed_reads(a, keys, False, ROUNDS // 4)
    plain, latest = [], []
    for _ in range(2):
        plain += await timed_reads(a, keys, False, ROUNDS // 2)
        latest += await timed_reads(a, keys, True, ROUNDS // 2)
    rows["plain regional read (ceiling)"] = summary(plain)
    rows["force_latest, region current"] = summary(latest)
    for start in range(0, KEYS, BATCH):
        await b.put(keys[start : start + BATCH], payloads[start : start + BATCH])
    await b.flush()
    rows["force_latest, region stale"] = summary(await timed_reads(a, keys, True, KEYS // BATCH))
    stats = a.stats()
    await a.close()
    await b.close()
    return {"rows": rows, "refreshed": stats["refreshed"]}


def main() -> None:
    servers = [RedisServer().start() for _ in range(3)]
    try:
        result = asyncio.run(run(*servers))
    finally:
        for server in servers:
            server.close()
    rows = result["rows"]
    ceiling = rows["plain regional read (ceiling)"]["p50_ms"]
    print(f"batches of {BATCH} x {BLOCK_BYTES // 1024} KiB, loopback redis-servers")
    print(f"{'read':<34}{'mean ms':>9}{'p50 ms':>9}{'p95 ms':>9}{'p50 / ceiling':>15}")
    for name, row in rows.items():
        ratio = row["p50_ms"] / ceiling
        print(f"{name:<34}{row['mean_ms']:>9.2f}{row['p50_ms']:>9.2f}{row['p95_ms']:>9.2f}{ratio:>15.2f}")
    result.update({"batch": BATCH, "block_bytes": BLOCK_BYTES})
    print(f"wrote {write_result(__file__, result)}")


if __name__ == "__main__":
    main()
