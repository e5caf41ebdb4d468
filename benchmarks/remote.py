"""The Redis tier at the server's own speed: GET/SET throughput of 64 KiB and 2 MiB blocks.

For each value size, on one redis-server and on a 3-node Redis Cluster (all on
loopback, started here and stopped at the end), in one run:

* ``redis-benchmark`` with the same value size, best over ``-c 1/4/8`` x
  ``-P 1/16`` (``-r``: overwriting a small key space): the server's ceiling on
  this machine;
* the Redis tier with its default options, in overwrite mode as ``redis-benchmark
  -r`` is: batches of ``put`` / ``get_into`` walk a key space of 256 MiB of
  distinct values that was written once before timing. GET is timed with one
  load at a time and with two loads outstanding (the manager runs several
  transfers per tier at once). Client CPU per value (all threads of this
  process) and redis-server CPU per value are reported next to the rates.
  Each timed repetition follows one more redis-benchmark run at its best
  setting, and ``tier/ceil`` is the median of these paired ratios (the best
  rates' ratio is in the JSON as ``tier_best_vs_best_setting``);
* a plain redis-py pipeline (``SET``/``GET`` of ``bytes`` values, no validation);
* on one server, SET through the leanest client possible (one socket, one
  ``sendmsg`` per value, as many in flight as the tier keeps, no value check): once over the tier's
  distinct payloads and once sending one payload over and over, as
  redis-benchmark does (its value stays in the CPU cache). The two show what
  sending distinct bytes costs on this machine, apart from anything the tier does;
* the value check on its own: xxh3-64 (the codec without a secret) next to the
  keyed BLAKE2b MAC (the codec with one), GB/s over one block.

Rates are the best of a few repetitions, because a shared 2-core machine moves
15-30% between runs (and more from one minute to the next). Prints a table and
writes ``remote.json`` next to this script. The file tier's figures are in
``benchmarks/file_tier.py``; the regional tier's in ``benchmarks/sync.py``.

    python benchmarks/remote.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import redis
import redis.cluster

from tiercache.blocks.codec import Codec
from tiercache.testing.redis_servers import FINGERPRINT, RedisClusterNodes, RedisServer, remote_context
from tiercache.tiers.redis import RedisOptions, RedisTier

SIZES = {"64KiB": 64 * 1024, "2MiB": 2 * 1024 * 1024}
BATCH_BLOCKS = {"64KiB": 64, "2MiB": 16}
"""Blocks per tier call (what a transfer-queue batch would carry)."""
KEYSPACE_BYTES = 256 * 2**20
"""Distinct values the tier overwrites and reads back (one timed repetition moves all of them)."""
REPEATS = 3
OUTSTANDING = 2
"""Loads in flight at once in the 'GET x2' row."""
BENCH_CLIENTS = (1, 4, 8)
BENCH_PIPELINES = (1, 16)
BENCH_REQUESTS = {"64KiB": 3000, "2MiB": 200}
BENCH_KEYSPACE = 64
"""redis-benchmark -r: spread keys (over the cluster's nodes) yet keep them all SET before GETs."""
SERVER_MAXMEMORY = "3gb"
CHECK_ROUNDS = 200
"""Repetitions of the value-check timing."""
SECRET = b"benchmark-secret-0123456789abcdef"
GB = 1e9
MICROSECONDS = 1e6
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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


def run_redis_benchmark(
    host: str, port: int, size: str, cluster: bool, clients: int, pipeline: int, ops: str = "set,get"
) -> tuple[dict[str, float], bool]:
    """GB/s per op of one redis-benchmark run, and whether it ran to the end."""
    argv = ["redis-benchmark", "-h", host, "-p", str(port), "-t", ops,
            "-d", str(SIZES[size]), "-n", str(BENCH_REQUESTS[size]), "-r", str(BENCH_KEYSPACE),
            "-c", str(clients), "-P", str(pipeline), "-q"]
    if cluster:
        argv.append("--cluster")
    result = subprocess.run(argv, capture_output=True, text=True)
    rates = {op: float(rps) * SIZES[size] / GB
             for op, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", result.stdout)}
    return rates, result.returncode == 0


def redis_benchmark(host: str, port: int, size: str, cluster: bool) -> dict[str, dict]:
    """Best SET and GET GB/s of redis-benchmark over the client/pipeline settings.

    A setting redis-benchmark aborts on (in cluster mode, ``-P 16``: "All clients
    disconnected") is recorded under ``failed`` and left out of the best.
    """
    best: dict[str, dict] = {"failed": {"settings": []}}
    for clients in BENCH_CLIENTS:
        for pipeline in BENCH_PIPELINES:
            rates, finished = run_redis_benchmark(host, port, size, cluster, clients, pipeline)
            if not finished:
                best["failed"]["settings"].append(f"-c {clients} -P {pipeline}")
            for op, rate in rates.items():
                if rate > best.get(op, {}).get("gbps", 0.0):
                    best[op] = {"gbps": rate, "clients": clients, "pipeline": pipeline}
    return best


def at_best_setting(host: str, port: int, size: str, cluster: bool, best: dict[str, dict], op: str) -> float:
    """GB/s of one more redis-benchmark run of ``op`` at its best setting (``best`` from ``redis_benchmark``)."""
    rates, _ = run_redis_benchmark(host, port, size, cluster, best[op]["clients"], best[op]["pipeline"], op.lower())
    return rates.get(op, 0.0)


def server_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the redis-server processes so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


async def best_rate(
    run: Callable[[], Awaitable[object]], nbytes: int, values: int, pids: list[int],
    ceiling: Callable[[], float] | None = None,
) -> dict:
    """Best GB/s of ``REPEATS`` timed runs of ``run``, and the median CPU µs per value.

    With a ``ceiling`` (a redis-benchmark run at its best setting), each run
    follows one, and ``paired_ratio`` is the median of the run-by-run ratios: the
    machine's speed drifts by tens of percent from minute to minute here, and a
    pair taken seconds apart shares that drift.
    """
    best = 0.0
    client_us: list[float] = []
    server_us: list[float] = []
    ratios: list[float] = []
    for _ in range(REPEATS):
        reference = ceiling() if ceiling is not None else 0.0
        cpu, server, started = time.process_time(), server_cpu_s(pids), time.perf_counter()
        await run()
        elapsed = time.perf_counter() - started
        client_us.append((time.process_time() - cpu) * MICROSECONDS / values)
        server_us.append((server_cpu_s(pids) - server) * MICROSECONDS / values)
        best = max(best, nbytes / elapsed / GB)
        if reference:
            ratios.append(nbytes / elapsed / GB / reference)
    return {"gbps": best, "client_cpu_us": float(np.median(client_us)), "server_cpu_us": float(np.median(server_us)),
            "paired_ratio": float(np.median(ratios)) if ratios else float("nan")}


def buffers(count: int, size: int) -> tuple[list[memoryview], list[memoryview]]:
    """``count`` random payloads and as many destination buffers (reused over the key space)."""
    rng = np.random.default_rng(0)
    data = [memoryview(rng.integers(0, 256, size, dtype=np.uint8)).cast("B") for _ in range(count)]
    dests = [memoryview(np.empty(size, dtype=np.uint8)).cast("B") for _ in range(count)]
    return data, dests


async def tier_rates(
    tier: RedisTier, size: str, pids: list[int], ceiling: Callable[[str], float]
) -> dict[str, dict]:
    """The tier's SET, GET and GET x2 rates; each repetition paired with ``ceiling(op)``."""
    block = SIZES[size]
    batch = BATCH_BLOCKS[size]
    rng = np.random.default_rng(1)
    keys = [rng.bytes(16) for _ in range(KEYSPACE_BYTES // block)]
    batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    data, _ = buffers(batch, block)
    lanes = [buffers(batch, block)[1] for _ in range(OUTSTANDING)]

    async def put() -> None:
        for chunk in batches:
            assert all(await tier.put(chunk, data[: len(chunk)]))

    async def get_lane(lane: int, lanes_total: int) -> None:
        for chunk in batches[lane::lanes_total]:
            assert all(await tier.get_into(chunk, lanes[lane][: len(chunk)]))

    async def get() -> None:
        await get_lane(0, 1)

    async def get_outstanding() -> None:
        await asyncio.gather(*(get_lane(lane, OUTSTANDING) for lane in range(OUTSTANDING)))

    await put()
    moved = len(keys) * block
    return {
        "SET": await best_rate(put, moved, len(keys), pids, lambda: ceiling("SET")),
        "GET": await best_rate(get, moved, len(keys), pids, lambda: ceiling("GET")),
        f"GET x{OUTSTANDING}": await best_rate(get_outstanding, moved, len(keys), pids, lambda: ceiling("GET")),
    }


async def redis_py_rates(client: redis.Redis | redis.cluster.RedisCluster, size: str) -> dict[str, float]:
    block = SIZES[size]
    batch = BATCH_BLOCKS[size]
    rounds = max(1, KEYSPACE_BYTES // (batch * block))
    data, _ = buffers(batch, block)
    names = [b"plain:%d" % i for i in range(batch)]
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
    count = rounds * batch
    return {"SET": (await best_rate(put, moved, count, []))["gbps"],
            "GET": (await best_rate(get, moved, count, []))["gbps"]}


def socket_loop_rate(host: str, port: int, size: str, distinct: bool) -> float:
    """Best SET GB/s of a bare socket loop over the tier's key space (no value check), written
    once untimed first: overwrites, as the tier's timed SETs are.

    ``distinct``: the payloads the tier stores, in turn; else the first one every time.
    """
    block = SIZES[size]
    data, _ = buffers(BATCH_BLOCKS[size], block)
    count = KEYSPACE_BYTES // block
    commands = [b"*3\r\n$3\r\nSET\r\n$9\r\nloop:%04d\r\n$%d\r\n" % (i % 10000, block) for i in range(count)]
    in_flight = RedisOptions().window_for(block)  # as many as the tier keeps
    replies = bytearray(len(b"+OK\r\n") * in_flight)
    best = 0.0
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for repetition in range(REPEATS + 1):
            pending = 0
            started = time.perf_counter()
            for i, head in enumerate(commands):
                sock.sendmsg([head, data[i % len(data)] if distinct else data[0], b"\r\n"])
                pending += 1
                while pending >= in_flight:
                    pending -= sock.recv_into(replies) // len(b"+OK\r\n")
            while pending:
                pending -= sock.recv_into(replies) // len(b"+OK\r\n")
            if repetition:
                best = max(best, count * block / (time.perf_counter() - started) / GB)
    return best


def check_rates() -> list[dict]:
    """GB/s of the value check alone: xxh3-64 (no secret) and the keyed MAC (with one)."""
    rows = []
    key = bytes(16)
    for size, block in SIZES.items():
        payload = memoryview(np.random.default_rng(2).integers(0, 256, block, dtype=np.uint8)).cast("B")
        dest = memoryview(bytearray(block))
        rates = {}
        for name, codec in (("xxh3", Codec(FINGERPRINT)), ("mac", Codec(FINGERPRINT, secret=SECRET))):
            value = codec.encode_value(key, payload)
            best = 0.0
            for _ in range(REPEATS):
                started = time.perf_counter()
                for _ in range(CHECK_ROUNDS):
                    assert codec.decode_into(key, value, dest).ok
                best = max(best, CHECK_ROUNDS * block / (time.perf_counter() - started) / GB)
            rates[name] = best
        rows.append({"size": size, "xxh3_gbps": rates["xxh3"], "mac_gbps": rates["mac"]})
    return rows


async def redis_rows(
    host: str, port: int, url: str, cluster: bool, client_factory: Callable, pids: list[int]
) -> list[dict]:
    rows = []
    client = client_factory()
    try:
        for size, block in SIZES.items():
            ceiling = redis_benchmark(host, port, size, cluster)
            options = RedisOptions(url=url, cluster=cluster)
            tier = RedisTier(remote_context(block, "redis"), options)
            await tier.start()
            try:
                ours = await tier_rates(tier, size, pids, functools.partial(at_best_setting, host, port, size,
                                                                            cluster, ceiling))
            finally:
                await tier.close()
            client.flushall()
            plain = await redis_py_rates(client, size)
            client.flushall()
            loop = {} if cluster else {
                "distinct": socket_loop_rate(host, port, size, True), "one": socket_loop_rate(host, port, size, False)
            }
            client.flushall()
            for op, rate in ours.items():
                base = op.split()[0]
                rows.append({
                    "target": "cluster x3" if cluster else "single",
                    "size": size,
                    "op": op,
                    "redis_benchmark_gbps": ceiling[base]["gbps"],
                    "redis_benchmark_setting": f"-c {ceiling[base]['clients']} -P {ceiling[base]['pipeline']}",
                    "redis_benchmark_failed_settings": ceiling["failed"]["settings"],
                    "tier_gbps": rate["gbps"],
                    "tier_client_cpu_us_per_value": rate["client_cpu_us"],
                    "server_cpu_us_per_value": rate["server_cpu_us"],
                    "redis_py_pipeline_gbps": plain[base],
                    "tier_vs_ceiling": rate["paired_ratio"],
                    "tier_best_vs_best_setting": rate["gbps"] / ceiling[base]["gbps"],
                    "tier_vs_redis_py": rate["gbps"] / plain[base],
                })
                if loop and base == "SET":
                    rows[-1].update({
                        "socket_loop_distinct_gbps": loop["distinct"],
                        "socket_loop_one_value_gbps": loop["one"],
                        "tier_vs_socket_loop_distinct": rate["gbps"] / loop["distinct"],
                    })
    finally:
        client.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, a smaller key space")
    parser.add_argument("--single", action="store_true", help="one redis-server only (no cluster rows)")
    args = parser.parse_args()
    global REPEATS, KEYSPACE_BYTES
    if args.quick:
        REPEATS, KEYSPACE_BYTES = 1, KEYSPACE_BYTES // 4
    info = machine_info()
    started = time.perf_counter()
    rows: list[dict] = []
    with RedisServer(maxmemory=SERVER_MAXMEMORY) as server:
        rows += await redis_rows(server.host, server.port, server.url, False,
                                 lambda: redis.Redis(host=server.host, port=server.port), [server.process.pid])
    if not args.single:
        with RedisClusterNodes() as cluster:
            for node in cluster.nodes:
                node.cli("CONFIG", "SET", "maxmemory", SERVER_MAXMEMORY)
            rows += await redis_rows(cluster.host, cluster.port, cluster.url, True,
                                     lambda: redis.cluster.RedisCluster(host=cluster.host, port=cluster.port),
                                     [node.process.pid for node in cluster.nodes])
    checks = check_rates()
    info["load_average_end"] = os.getloadavg()
    info["runtime_s"] = time.perf_counter() - started

    print(f"{'target':<11}{'size':>6}{'op':>7}  {'redis-bench':>11}  {'tier':>6}  {'redis-py':>8}"
          f"  {'tier/ceil':>9}  {'cpu us/value':>12}  {'server us':>9}   (GB/s)")
    for r in rows:
        print(f"{r['target']:<11}{r['size']:>6}{r['op']:>7}  {r['redis_benchmark_gbps']:>11.2f}"
              f"  {r['tier_gbps']:>6.2f}  {r['redis_py_pipeline_gbps']:>8.2f}"
              f"  {r['tier_vs_ceiling']:>9.2f}  {r['tier_client_cpu_us_per_value']:>12.1f}"
              f"  {r['server_cpu_us_per_value']:>9.1f}")
    print(f"\n{'SET':<11}{'size':>6}  {'redis-bench':>11}  {'loop, 1 value':>13}  {'loop, distinct':>14}"
          f"  {'tier':>6}  {'tier/loop distinct':>18}   (GB/s)")
    for r in rows:
        if "socket_loop_distinct_gbps" in r:
            print(f"{r['target']:<11}{r['size']:>6}  {r['redis_benchmark_gbps']:>11.2f}"
                  f"  {r['socket_loop_one_value_gbps']:>13.2f}  {r['socket_loop_distinct_gbps']:>14.2f}"
                  f"  {r['tier_gbps']:>6.2f}  {r['tier_vs_socket_loop_distinct']:>18.2f}")
    print(f"\n{'value check':<11}{'size':>6}  {'xxh3':>6}  {'keyed MAC':>9}   (GB/s)")
    for r in checks:
        print(f"{'':<11}{r['size']:>6}  {r['xxh3_gbps']:>6.2f}  {r['mac_gbps']:>9.2f}")
    print(f"\n{info['cpu']}, {info['cores']} cores, {info['redis_server'].split()[2]}, "
          f"load {info['load_average_start'][0]:.1f} -> {info['load_average_end'][0]:.1f}, "
          f"{info['runtime_s']:.0f} s")
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"machine": info, "redis": rows, "value_check": checks}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
