"""The Redis tier at the server's own speed: GET/SET of 64 KiB to 4 MiB blocks against redis-benchmark.

For each value size, on one redis-server (and a 3-node Redis Cluster unless
``--single``), ``ROUNDS`` rounds, each taking in turn (so that the machine's
drift from one minute to the next hits every client alike):

* ``redis-benchmark`` swept over ``-c 1/4/8`` x ``-P 1/16``, to find its best
  setting per command (``redis_ceiling.py``);
* the Redis tier, default options, overwriting a key space of 256 MiB of
  distinct values in transfer-queue-sized batches, each op twice in mirrored
  order, each pass next to a fresh run of redis-benchmark's best setting for
  its command; the better of the two tier passes counts against the better of
  its two ceiling runs (the server's pace moves up to 2x from one pass to the
  next here, and the sweep's best is the largest of six such draws). SET as the
  manager sends it, each block's checksum carried from where it was copied into
  the CPU tier (``SET``); SET hashing every value in the I/O thread, as a writer
  that carries none (``SET, hashing``); GET and SET one call at a time, and
  ``GET x2`` / ``SET x2`` with two calls outstanding, as the manager's loads
  (their chunks fetched at once) and write-backs (one task per move) run;
  every value read is validated (header and xxh3 checksum) before it counts;
* on one server, a bare socket loop with no value check, sending the tier's
  distinct payloads and sending one payload over and over as redis-benchmark
  does (what sending distinct bytes costs on this machine, apart from the tier);
  and reading distinct values into slots, in one stream that never drains (as
  redis-benchmark asks) and in batches of the tier's call size that drain (as
  one call at a time must): what the call shape alone costs, apart from the tier.

``tier / ceiling`` is the median over the rounds of the tier's rate over its
paired ceiling runs; ``tier / sweep`` over the sweep's best draw instead (the
ratio this benchmark reported before). The rates and the winning setting are
in the JSON. Client CPU per value (all threads of this process) and the server's are
medians too. The value check alone (xxh3-64 on hot and cold bytes, the keyed
MAC) is timed at the end. Prints a table; writes ``remote.json``.

    python benchmarks/remote.py [--quick] [--single] [--out PATH]
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import redis_ceiling
from common import arguments, parse, write_result
from redis_ceiling import rerun, socket_get_rate, socket_loop_rate, sweep

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import payload_checksum
from tiercache.common.units import US_PER_SECOND
from tiercache.testing.redis_servers import FINGERPRINT, RedisClusterNodes, RedisServer, remote_context, slot_views
from tiercache.tiers.redis import RedisOptions, RedisTier

KIB, MIB = 1024, 2**20
SIZES = {"64KiB": 64 * KIB, "512KiB": 512 * KIB, "2MiB": 2 * MIB, "4MiB": 4 * MIB}
BATCH_BYTES = 32 * MIB
"""Bytes per tier call (a transfer-queue batch), at most ``MAX_BATCH`` blocks."""
MAX_BATCH = 64
KEYSPACE_BYTES = 256 * MIB
"""Distinct values the tier overwrites and reads back (one timed pass moves all of them)."""
ROUNDS = 5
OUTSTANDING = 2
"""Calls in flight at once in the 'SET x2' and 'GET x2' rows."""
SERVER_MAXMEMORY = "3gb"
CHECK_BYTES = 256 * MIB
"""Bytes hashed per value-check timing (cold: that many distinct bytes)."""
SECRET = b"benchmark-secret-0123456789abcdef"
GB = 1e9
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
OPS = ("SET", "SET, hashing", f"SET x{OUTSTANDING}", "GET", f"GET x{OUTSTANDING}")
LOOPS = {"SET": ("distinct", "one_value"), "GET": ("drained", "stream")}
"""Per command, the bare loop the tier is compared with (it sends or asks as the tier does), then the other."""
QUICK = {"SIZES": {"64KiB": 64 * KIB}, "KEYSPACE_BYTES": 2 * MIB, "ROUNDS": 1, "CHECK_BYTES": MIB}
QUICK_CEILING = {"CLIENTS": (1,), "PIPELINES": (1,), "REQUEST_BYTES": 2 * MIB, "MIN_REQUESTS": 1}
"""The constants ``--quick`` replaces, here and in ``redis_ceiling`` (one redis-benchmark setting, short runs)."""


def server_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the redis-server processes so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


async def timed(run: Callable[[], Awaitable[object]], nbytes: int, values: int, pids: list[int]) -> dict:
    """GB/s of one pass of ``run``, with client and server CPU µs per value."""
    cpu, server, started = time.process_time(), server_cpu_s(pids), time.perf_counter()
    await run()
    elapsed = time.perf_counter() - started
    return {"gbps": nbytes / elapsed / GB,
            "client_us": (time.process_time() - cpu) * US_PER_SECOND / values,
            "server_us": (server_cpu_s(pids) - server) * US_PER_SECOND / values}


class TierPasses:
    """The tier's timed passes over one key space of one value size."""

    def __init__(self, tier: RedisTier, block: int, pids: list[int]) -> None:
        self.tier, self.block, self.pids = tier, block, pids
        batch = max(1, min(MAX_BATCH, BATCH_BYTES // block))
        rng = np.random.default_rng(1)
        keys = [rng.bytes(16) for _ in range(KEYSPACE_BYTES // block)]
        self.batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
        self.data = slot_views(batch, block, 0)  # random blocks in slots, as a CPU tier's
        self.checksums = [payload_checksum(view) for view in self.data]  # as the CPU tier took them at copy time
        self.dests = [slot_views(batch, block, 2 + lane) for lane in range(OUTSTANDING)]
        self.values = len(keys)

    async def put(self, carried: bool, lane: int = 0, lanes: int = 1) -> None:
        for chunk in self.batches[lane::lanes]:
            sums = self.checksums[: len(chunk)] if carried else None
            assert all(await self.tier.put(chunk, self.data[: len(chunk)], checksums=sums))

    async def get(self, lane: int, lanes: int) -> None:
        for chunk in self.batches[lane::lanes]:
            assert all(await self.tier.get_into(chunk, self.dests[lane][: len(chunk)]))

    async def round(self, ceiling: Callable[[str], float]) -> dict[str, dict]:
        """Two timed passes of each op, each next to a fresh run of redis-benchmark's best setting for its
        command (``ceiling``), in mirrored order (tier then ceiling, later ceiling then tier: the server's
        pace moves from pass to pass), after an untimed pass that writes the key space. The better tier
        pass counts, over the better of its two ceiling runs: both sides get the same number of draws."""
        await self.put(True)
        moved = self.values * self.block

        async def puts() -> None:
            await asyncio.gather(*(self.put(True, lane, OUTSTANDING) for lane in range(OUTSTANDING)))

        async def gets() -> None:
            await asyncio.gather(*(self.get(lane, OUTSTANDING) for lane in range(OUTSTANDING)))

        runs = [("SET", lambda: self.put(True)), ("SET, hashing", lambda: self.put(False)),
                (f"SET x{OUTSTANDING}", puts), ("GET", lambda: self.get(0, 1)), (f"GET x{OUTSTANDING}", gets)]
        best: dict[str, dict] = {}
        for mirrored, order in ((False, runs), (True, runs[::-1])):
            for op, run in order:
                before = ceiling(command_of(op)) if mirrored else 0.0
                result = await timed(run, moved, self.values, self.pids)
                after = 0.0 if mirrored else ceiling(command_of(op))
                kept = best.setdefault(op, {"gbps": 0.0, "ceiling_gbps": 0.0})
                if result["gbps"] > kept["gbps"]:
                    kept.update(result)
                kept["ceiling_gbps"] = max(kept["ceiling_gbps"], before, after)
        return best


def command_of(op: str) -> str:
    """The redis-benchmark command an op is measured against (``SET, hashing`` and ``SET x2``: ``SET``)."""
    return op.split(",")[0].split()[0]


async def size_rows(host: str, port: int, url: str, cluster: bool, pids: list[int], size: str) -> list[dict]:
    """Every op's row for one value size: ``ROUNDS`` interleaved rounds of ceiling, tier and loop."""
    block = SIZES[size]
    tier = RedisTier(remote_context(block, "redis"), RedisOptions(url=url, cluster=cluster))
    await tier.start()
    rounds: list[dict] = []
    try:
        passes = TierPasses(tier, block, pids)
        for _ in range(ROUNDS):
            ceiling = sweep(host, port, block, cluster)
            ours = await passes.round(functools.partial(rerun, host, port, block, cluster, ceiling))
            window = RedisOptions().window_for(block)
            loop = None if cluster else {
                "distinct": socket_loop_rate(host, port, passes.data, passes.values, window, True),
                "one_value": socket_loop_rate(host, port, passes.data, passes.values, window, False),
                "stream": socket_get_rate(host, port, passes.data, passes.dests[0], passes.values, window, None),
                "drained": socket_get_rate(
                    host, port, passes.data, passes.dests[0], passes.values, window, len(passes.batches[0])
                ),
            }
            rounds.append({"ceiling": ceiling, "tier": ours, "loop": loop})
    finally:
        await tier.close()
    rows = []
    for op in OPS:
        base = command_of(op)
        sweeps = [r["ceiling"][base]["gbps"] for r in rounds]
        ceilings = [r["tier"][op]["ceiling_gbps"] for r in rounds]
        rates = [r["tier"][op]["gbps"] for r in rounds]
        best = max(range(ROUNDS), key=lambda i: ceilings[i])
        row = {
            "target": "cluster x3" if cluster else "single", "size": size, "op": op,
            "redis_benchmark_gbps": ceilings[best],
            "redis_benchmark_setting": rounds[best]["ceiling"][base]["setting"],
            "redis_benchmark_settings_won": [r["ceiling"][base]["setting"] for r in rounds],
            "redis_benchmark_failed_settings": sorted({s for r in rounds for s in r["ceiling"]["failed"]["settings"]}),
            "redis_benchmark_sweep_gbps": max(sweeps),
            "tier_gbps": max(rates),
            "tier_vs_ceiling": statistics.median(t / c for t, c in zip(rates, ceilings, strict=True)),
            "tier_vs_sweep": statistics.median(t / c for t, c in zip(rates, sweeps, strict=True)),
            "tier_best_vs_best": max(rates) / ceilings[best],
            "tier_client_cpu_us_per_value": statistics.median(r["tier"][op]["client_us"] for r in rounds),
            "server_cpu_us_per_value": statistics.median(r["tier"][op]["server_us"] for r in rounds),
            "rounds": [{"redis_benchmark_sweep": w, "redis_benchmark": c, "tier": t}
                       for w, c, t in zip(sweeps, ceilings, rates, strict=True)],
        }
        if not cluster:
            row.update(loop_columns(base, [r["loop"] for r in rounds], rates, ceilings))
        rows.append(row)
    return rows


def loop_columns(command: str, loops: list[dict], rates: list[float], ceilings: list[float]) -> dict:
    """The bare socket loops of each round next to the tier and redis-benchmark (``LOOPS``: for SET the
    distinct-payload loop, then the one-payload loop; for GET the drained-batch loop, then the stream)."""
    compared = LOOPS[command][0]
    columns: dict = {"socket_loop_compared": compared}
    for name in LOOPS[command]:
        runs = [loop[name] for loop in loops]
        columns[f"socket_loop_{name}_gbps"] = max(runs)
        columns[f"socket_loop_{name}_vs_ceiling"] = statistics.median(
            lp / c for lp, c in zip(runs, ceilings, strict=True)
        )
        if name == compared:
            columns["tier_vs_socket_loop"] = statistics.median(t / lp for t, lp in zip(rates, runs, strict=True))
    return columns


def check_rates() -> list[dict]:
    """GB/s of the value check alone: xxh3-64 on one block (hot) and on 256 MiB of distinct blocks (cold, as a
    write path that hashes a block long after it was written meets them), and the keyed MAC (hot)."""
    rows = []
    key = bytes(16)
    for size, block in SIZES.items():
        cold = slot_views(CHECK_BYTES // block, block, 3)
        hot = cold[0]
        started = time.perf_counter()
        for view in cold:
            payload_checksum(view)
        cold_gbps = CHECK_BYTES / (time.perf_counter() - started) / GB
        started = time.perf_counter()
        for _ in cold:
            payload_checksum(hot)
        hot_gbps = CHECK_BYTES / (time.perf_counter() - started) / GB
        keyed = Codec(FINGERPRINT, secret=SECRET)
        rounds = max(1, 64 * MIB // block)
        started = time.perf_counter()
        for _ in range(rounds):
            keyed.encode(key, hot)
        mac_gbps = rounds * block / (time.perf_counter() - started) / GB
        rows.append({"size": size, "xxh3_hot_gbps": hot_gbps, "xxh3_cold_gbps": cold_gbps, "mac_gbps": mac_gbps})
    return rows


def print_table(rows: list[dict], checks: list[dict], info: dict) -> None:
    print(f"{'target':<11}{'size':>7} {'op':<13}{'redis-bench':>11} {'(setting)':<12}{'sweep':>6}{'tier':>6}"
          f"{'tier/ceil':>10}{'tier/sweep':>11}{'loop':>7}{'tier/loop':>10}{'cpu us/value':>13}{'server us':>10}"
          "   (GB/s)")
    for r in rows:
        compared = r.get("socket_loop_compared")
        loop = f"{'':>17}"
        if compared:
            loop = f"{r[f'socket_loop_{compared}_gbps']:>7.2f}{r['tier_vs_socket_loop']:>10.2f}"
        print(f"{r['target']:<11}{r['size']:>7} {r['op']:<13}{r['redis_benchmark_gbps']:>11.2f}"
              f" {r['redis_benchmark_setting']:<12}{r['redis_benchmark_sweep_gbps']:>6.2f}{r['tier_gbps']:>6.2f}"
              f"{r['tier_vs_ceiling']:>10.2f}{r['tier_vs_sweep']:>11.2f}{loop}"
              f"{r['tier_client_cpu_us_per_value']:>13.1f}{r['server_cpu_us_per_value']:>10.1f}")
    print(f"\n{'loops':<11}{'size':>7}  {'cmd':<4}{'redis-bench':>11}  {'loop':>14}  {'loop/ceil':>9}"
          f"  {'other loop':>16}  {'other/ceil':>10}  {'tier':>6}  (GB/s; ratios: medians of the rounds)")
    for r in rows:
        if r["op"] not in ("SET", "GET") or "socket_loop_compared" not in r:
            continue
        compared, other = LOOPS[r["op"]]
        print(f"{r['target']:<11}{r['size']:>7}  {r['op']:<4}{r['redis_benchmark_gbps']:>11.2f}"
              f"  {compared:>9} {r[f'socket_loop_{compared}_gbps']:>5.2f}"
              f"  {r[f'socket_loop_{compared}_vs_ceiling']:>9.2f}"
              f"  {other:>10} {r[f'socket_loop_{other}_gbps']:>5.2f}"
              f"  {r[f'socket_loop_{other}_vs_ceiling']:>10.2f}  {r['tier_gbps']:>6.2f}")
    print(f"\n{'value check':<11}{'size':>7}  {'xxh3 hot':>8}  {'xxh3 cold':>9}  {'keyed MAC':>9}   (GB/s)")
    for r in checks:
        print(f"{'':<11}{r['size']:>7}  {r['xxh3_hot_gbps']:>8.2f}  {r['xxh3_cold_gbps']:>9.2f}  {r['mac_gbps']:>9.2f}")
    print(f"\n{info['redis_server']}, load {info['load_average_start'][0]:.1f} -> {info['load_average_end'][0]:.1f},"
          f" {info['runtime_s']:.0f} s, {ROUNDS} rounds")


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="one redis-server only (no cluster rows)")
    args = parse(parser)
    if args.quick:
        globals().update(QUICK)
        vars(redis_ceiling).update(QUICK_CEILING)
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    info = {"redis_server": version, "load_average_start": os.getloadavg()}
    started = time.perf_counter()
    rows: list[dict] = []
    with RedisServer(maxmemory=SERVER_MAXMEMORY) as server:
        for size in SIZES:
            rows += await size_rows(server.host, server.port, server.url, False, [server.process.pid], size)
    if not args.single:
        with RedisClusterNodes() as cluster:
            for node in cluster.nodes:
                node.cli("CONFIG", "SET", "maxmemory", SERVER_MAXMEMORY)
            pids = [node.process.pid for node in cluster.nodes]
            for size in SIZES:
                rows += await size_rows(cluster.host, cluster.port, cluster.url, True, pids, size)
    checks = check_rates()
    info["load_average_end"] = os.getloadavg()
    info["runtime_s"] = time.perf_counter() - started
    print_table(rows, checks, info)
    print(f"wrote {write_result(__file__, {'info': info, 'redis': rows, 'value_check': checks}, args.out, args.quick)}")


if __name__ == "__main__":
    asyncio.run(main())
