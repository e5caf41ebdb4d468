"""Remote tiers at the server's own speed: GET/SET throughput of 64 KiB and 2 MiB blocks.

For each value size, on one redis-server and on a 3-node Redis Cluster (all on
loopback, started here and stopped at the end), in one run:

* ``redis-benchmark`` with the same value size, best over ``-c 1/4/8`` x
  ``-P 1/16``: the server's ceiling on this machine;
* the Redis tier (``put`` / ``get_into`` of whole batches; best over ``connections`` 1/2/4);
* a plain redis-py pipeline (``SET``/``GET`` of ``bytes`` values, no validation).

And the file tier next to a dd-style sequential write/read of the same bytes in
one file. Tier and redis-py figures are the best of a few repetitions,
interleaved, because a shared 2-core machine moves 15-30% between runs.
Prints a table and writes ``remote.json`` next to this script.

    python benchmarks/remote.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import redis
import redis.cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_servers import RedisClusterNodes, RedisServer, remote_context

from tiercache.tiers.file import FileOptions, FileTier
from tiercache.tiers.redis import RedisOptions, RedisTier

SIZES = {"64KiB": 64 * 1024, "2MiB": 2 * 1024 * 1024}
TIER_CONNECTIONS = (1, 2, 4)
"""The tier's ``connections`` settings tried; like redis-benchmark's, its figure is the best of them."""
BATCH_BLOCKS = {"64KiB": 64, "2MiB": 16}
"""Blocks per tier call (what a transfer-queue batch would carry)."""
ROUND_BYTES = 256 * 2**20
"""Bytes moved per timed repetition."""
REPEATS = 3
BENCH_CLIENTS = (1, 4, 8)
BENCH_PIPELINES = (1, 16)
BENCH_REQUESTS = {"64KiB": 3000, "2MiB": 200}
BENCH_KEYSPACE = 64
"""redis-benchmark -r: spread keys (over the cluster's nodes) yet keep them all SET before GETs."""
SERVER_MAXMEMORY = "3gb"
FILE_BYTES = {"64KiB": 64 * 2**20, "2MiB": 128 * 2**20}
GB = 1e9


def machine_info() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "redis_server": version,
        "redis_py": redis.__version__,
        "load_average_start": os.getloadavg(),
    }


def redis_benchmark(host: str, port: int, size: str, cluster: bool) -> dict[str, dict]:
    """Best SET and GET GB/s of redis-benchmark over the client/pipeline settings.

    A setting redis-benchmark aborts on (in cluster mode, ``-P 16``: "All clients
    disconnected") is recorded under ``failed`` and left out of the best.
    """
    best: dict[str, dict] = {"failed": {"settings": []}}
    for clients in BENCH_CLIENTS:
        for pipeline in BENCH_PIPELINES:
            argv = ["redis-benchmark", "-h", host, "-p", str(port), "-t", "set,get",
                    "-d", str(SIZES[size]), "-n", str(BENCH_REQUESTS[size]), "-r", str(BENCH_KEYSPACE),
                    "-c", str(clients), "-P", str(pipeline), "-q"]
            if cluster:
                argv.append("--cluster")
            result = subprocess.run(argv, capture_output=True, text=True)
            output = result.stdout
            if result.returncode != 0:
                best["failed"]["settings"].append(f"-c {clients} -P {pipeline}")
            for op, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", output):
                rate = float(rps) * SIZES[size] / GB
                if rate > best.get(op, {}).get("gbps", 0.0):
                    best[op] = {"gbps": rate, "clients": clients, "pipeline": pipeline}
    return best


async def best_rate(run: Callable[[], Awaitable[object]], nbytes: int) -> float:
    """Best GB/s of ``REPEATS`` timed runs of ``run`` (each moving ``nbytes``)."""
    best = 0.0
    for _ in range(REPEATS):
        started = time.perf_counter()
        await run()
        best = max(best, nbytes / (time.perf_counter() - started) / GB)
    return best


def payloads(count: int, size: int) -> tuple[list[bytes], list[memoryview], list[memoryview]]:
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(count)]
    data = [memoryview(rng.integers(0, 256, size, dtype=np.uint8)).cast("B") for _ in keys]
    dests = [memoryview(np.empty(size, dtype=np.uint8)).cast("B") for _ in keys]
    return keys, data, dests


async def tier_rates(tier: RedisTier | FileTier, size: str) -> dict[str, float]:
    block = SIZES[size]
    batch = BATCH_BLOCKS[size]
    rounds = max(1, ROUND_BYTES // (batch * block))
    keys, data, dests = payloads(batch, block)

    async def put() -> None:
        for _ in range(rounds):
            assert all(await tier.put(keys, data))

    async def get() -> None:
        for _ in range(rounds):
            assert all(await tier.get_into(keys, dests))

    await put()
    moved = rounds * batch * block
    return {"SET": await best_rate(put, moved), "GET": await best_rate(get, moved)}


async def redis_py_rates(client: redis.Redis | redis.cluster.RedisCluster, size: str) -> dict[str, float]:
    block = SIZES[size]
    batch = BATCH_BLOCKS[size]
    rounds = max(1, ROUND_BYTES // (batch * block))
    keys, data, _ = payloads(batch, block)
    names = [b"plain:" + key.hex().encode() for key in keys]
    values = [bytes(d) for d in data]

    async def put() -> None:
        for _ in range(rounds):
            pipe = client.pipeline(transaction=False)
            for name, value in zip(names, values, strict=True):
                pipe.set(name, value)
            pipe.execute()

    async def get() -> None:
        for _ in range(rounds):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            assert all(pipe.execute())

    await put()
    moved = rounds * batch * block
    return {"SET": await best_rate(put, moved), "GET": await best_rate(get, moved)}


def dd_rates(directory: Path, size: str) -> dict[str, float]:
    """Sequential write then read of the same bytes, one file, block-sized I/O."""
    block = SIZES[size]
    count = FILE_BYTES[size] // block
    _, data, dests = payloads(1, block)
    path = directory / "dd.bin"
    best = {"SET": 0.0, "GET": 0.0}
    for _ in range(REPEATS):
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(count):
            os.write(fd, data[0])
        os.close(fd)
        best["SET"] = max(best["SET"], count * block / (time.perf_counter() - started) / GB)
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            for _ in range(count):
                handle.readinto(dests[0])
        best["GET"] = max(best["GET"], count * block / (time.perf_counter() - started) / GB)
    path.unlink()
    return best


async def file_rates(directory: Path, size: str) -> dict[str, float]:
    block = SIZES[size]
    count = FILE_BYTES[size] // block
    tier = FileTier(remote_context(block, "file"), FileOptions(path=str(directory / "tier"), max_blocks=count * 2))
    await tier.start()
    try:
        keys, data, dests = payloads(count, block)

        async def put() -> None:
            assert all(await tier.put(keys, data))

        async def get() -> None:
            assert all(await tier.get_into(keys, dests))

        await put()
        return {"SET": await best_rate(put, count * block), "GET": await best_rate(get, count * block)}
    finally:
        await tier.close()


async def redis_rows(host: str, port: int, url: str, cluster: bool, client_factory: Callable) -> list[dict]:
    rows = []
    client = client_factory()
    try:
        for size, block in SIZES.items():
            ceiling = redis_benchmark(host, port, size, cluster)
            ours: dict[str, float] = {}
            setting: dict[str, int] = {}
            for connections in TIER_CONNECTIONS:
                options = RedisOptions(url=url, cluster=cluster, connections=connections)
                tier = RedisTier(remote_context(block, "redis"), options)
                await tier.start()
                try:
                    rates = await tier_rates(tier, size)
                finally:
                    await tier.close()
                for op, rate in rates.items():
                    if rate > ours.get(op, 0.0):
                        ours[op], setting[op] = rate, connections
            plain = await redis_py_rates(client, size)
            client.flushall()
            for op in ("SET", "GET"):
                rows.append({
                    "target": "cluster x3" if cluster else "single",
                    "size": size,
                    "op": op,
                    "redis_benchmark_gbps": ceiling[op]["gbps"],
                    "redis_benchmark_setting": f"-c {ceiling[op]['clients']} -P {ceiling[op]['pipeline']}",
                    "redis_benchmark_failed_settings": ceiling["failed"]["settings"],
                    "tier_gbps": ours[op],
                    "tier_connections": setting[op],
                    "redis_py_pipeline_gbps": plain[op],
                    "tier_vs_ceiling": ours[op] / ceiling[op]["gbps"],
                    "tier_vs_redis_py": ours[op] / plain[op],
                })
    finally:
        client.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, smaller rounds")
    args = parser.parse_args()
    global REPEATS, ROUND_BYTES
    if args.quick:
        REPEATS, ROUND_BYTES = 1, ROUND_BYTES // 4
    info = machine_info()
    started = time.perf_counter()
    rows: list[dict] = []
    with RedisServer(maxmemory=SERVER_MAXMEMORY) as server:
        rows += await redis_rows(server.host, server.port, server.url, False,
                                 lambda: redis.Redis(host=server.host, port=server.port))
    with RedisClusterNodes() as cluster:
        for node in cluster.nodes:
            node.cli("CONFIG", "SET", "maxmemory", SERVER_MAXMEMORY)
        rows += await redis_rows(cluster.host, cluster.port, cluster.url, True,
                                 lambda: redis.cluster.RedisCluster(host=cluster.host, port=cluster.port))
    file_rows = []
    directory = Path(tempfile.mkdtemp(prefix="tiercache-bench-", dir=os.environ.get("TIERCACHE_BENCH_DIR")))
    try:
        filesystem = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True).stdout
        for size in SIZES:
            dd = dd_rates(directory, size)
            ours = await file_rates(directory, size)
            for op in ("SET", "GET"):
                file_rows.append({"size": size, "op": op, "dd_gbps": dd[op], "tier_gbps": ours[op],
                                  "tier_vs_dd": ours[op] / dd[op]})
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    info["load_average_end"] = os.getloadavg()
    info["filesystem"] = filesystem.splitlines()[-1] if filesystem else ""
    info["runtime_s"] = time.perf_counter() - started

    print(f"{'target':<11}{'size':>6}{'op':>4}  {'redis-bench':>11}  {'tier':>6} {'conns':>5}  {'redis-py':>8}"
          f"  {'tier/ceil':>9}  {'tier/py':>7}   (GB/s)")
    for r in rows:
        print(f"{r['target']:<11}{r['size']:>6}{r['op']:>4}  {r['redis_benchmark_gbps']:>11.2f}"
              f"  {r['tier_gbps']:>6.2f} {r['tier_connections']:>5}  {r['redis_py_pipeline_gbps']:>8.2f}"
              f"  {r['tier_vs_ceiling']:>9.2f}  {r['tier_vs_redis_py']:>7.2f}")
    print(f"\n{'file tier':<11}{'size':>6}{'op':>4}  {'dd-style':>8}  {'tier':>6}  {'tier/dd':>7}   (GB/s)")
    for r in file_rows:
        print(f"{'':<11}{r['size']:>6}{r['op']:>4}  {r['dd_gbps']:>8.2f}  {r['tier_gbps']:>6.2f}"
              f"  {r['tier_vs_dd']:>7.2f}")
    print(f"\n{info['cpu']}, {info['cores']} cores, {info['redis_server'].split()[2]}, "
          f"load {info['load_average_start'][0]:.1f} -> {info['load_average_end'][0]:.1f}, "
          f"{info['runtime_s']:.0f} s")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"machine": info, "redis": rows, "file": file_rows}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
