"""The file tier next to dd-style sequential I/O of the same bytes on the same disk, in one run.

For 64 KiB and 2 MiB blocks: a dd-style ceiling (one file, block-sized
``write``/``readinto`` calls, no validation), the same reads into the blocks'
distinct slots from one thread and from as many threads as the tier reads with
(the most any reader that lands blocks in their slots gets from this machine's
cores and memory), and the tier (``put`` / ``get_into`` with header, checksum
and index; every SET pass overwrites the same keys, so the segments fill and GC
runs as in steady state; each block's checksum is carried, as the manager's
puts carry the one taken when the block was copied into the CPU tier). Two tier
shapes per size: the manager's load chunk (``queues.batch_blocks`` blocks per
call) and one other (the whole set at 64 KiB, 32 MiB batches at 2 MiB). Each of
``RUNS`` runs measures the ceiling and the tier back to back (interleaved); the
table shows medians over the runs of the rates and of the per-run ratios, with
the load average (a shared 2-core machine moves 15-30% between runs). Prints a
table and writes ``file_tier.json`` next to this script.

    python benchmarks/file_tier.py [--dir DIR] [--quick] [--out PATH]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from common import arguments, parse, write_result

from tiercache.blocks.value_format import payload_checksum
from tiercache.config.topology import QueueConfig
from tiercache.testing.redis_servers import remote_context, slot_views
from tiercache.tiers.file import FileOptions, FileTier
from tiercache.tiers.file.options import default_threads

SIZES = {"64KiB": 64 * 1024, "2MiB": 2 * 1024 * 1024}
SET_BYTES = {"64KiB": 64 * 2**20, "2MiB": 128 * 2**20}
"""Bytes moved per timed pass (the whole key set)."""
LOAD_CHUNK = QueueConfig().batch_blocks
SHAPES = {
    "64KiB": (("load chunk", LOAD_CHUNK), ("whole set", SET_BYTES["64KiB"] // SIZES["64KiB"])),
    "2MiB": (("load chunk", LOAD_CHUNK), ("32 MiB batch", 32 * 2**20 // SIZES["2MiB"])),
}
"""Blocks per tier call: a load's chunk (the manager fetches a load in chunks of ``queues.batch_blocks``), and
one other shape per size."""
CAPACITY_FACTOR = 3
"""The tier's max_bytes as a multiple of the key set: overwrites fill it and GC runs."""
RUNS = 5
READ_PASSES = 8
"""Reads of the whole key set per timed GET (dd's and the tier's alike): one read of 128 MiB lasts ~13 ms
here, too short a window on a shared machine."""
GB = 1e9
QUICK_SET_BYTES = {"64KiB": 2 * 2**20, "2MiB": 8 * 2**20}
QUICK = {
    "SET_BYTES": QUICK_SET_BYTES,
    "SHAPES": {
        "64KiB": (("load chunk", LOAD_CHUNK), ("whole set", QUICK_SET_BYTES["64KiB"] // SIZES["64KiB"])),
        "2MiB": (("load chunk", LOAD_CHUNK), ("2 MiB batch", 1)),
    },
    "RUNS": 1,
    "READ_PASSES": 1,
}
"""The constants ``--quick`` replaces: key sets of 2 and 8 MiB, one run, one read per pass."""


Blocks = tuple[list[bytes], list[memoryview], list[memoryview]]


def blocks(count: int, size: int) -> Blocks:
    """Keys, random payloads and destinations, both slots of one allocation as a CPU tier's are; destinations
    are touched now (a CPU tier's pages exist long before a load), so no pass pays first-touch page faults."""
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(count)]
    dests = slot_views(count, size)
    for dest in dests:
        np.frombuffer(dest, np.uint8).fill(1)
    return keys, slot_views(count, size, seed=1), dests


def parallel_reads(path: Path, block: int, dests: list[memoryview], threads: int) -> float:
    """GB/s of ``READ_PASSES`` reads of the file into ``dests`` by ``threads`` threads, each reading its
    contiguous share of the blocks through its own descriptor (bare ``preadv``, nothing checked)."""
    shares = [range(len(dests) * t // threads, len(dests) * (t + 1) // threads) for t in range(threads)]

    def read(share: range) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(READ_PASSES):
                for index in share:
                    os.preadv(fd, [dests[index]], index * block)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(read, shares))
        return READ_PASSES * len(dests) * block / (time.perf_counter() - started) / GB


def dd_pass(directory: Path, size: str, key_set: Blocks) -> dict[str, float]:
    """One sequential write then ``READ_PASSES`` reads of ``SET_BYTES`` in block-sized calls (GB/s).

    ``SET`` writes one buffer over and over and ``GET`` reads into one reused
    buffer, as ``dd`` does (the buffer stays in the CPU's cache); ``SET_distinct``
    writes the key set's distinct payloads and ``GET_distinct`` reads into its
    distinct destinations, as a store and a load must (each block has its own
    slot): the ceilings for any writer and reader of real blocks from one
    thread. ``GET_parallel``: those reads by the tier's number of reader threads.
    """
    block = SIZES[size]
    count = SET_BYTES[size] // block
    _, data, dests = blocks(1, block)
    path = directory / "dd.bin"

    def write(sources: list[memoryview]) -> float:
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # as dd: dropping the old bytes is timed
        for index in range(count):
            os.write(fd, sources[index % len(sources)])
        os.close(fd)
        return count * block / (time.perf_counter() - started) / GB

    write_distinct = write(key_set[1][:count])
    write_one = write(data[:1])
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        for _ in range(READ_PASSES):
            handle.seek(0)
            for _ in range(count):
                handle.readinto(dests[0])
    read = READ_PASSES * count * block / (time.perf_counter() - started) / GB
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        for _ in range(READ_PASSES):
            handle.seek(0)
            for dest in key_set[2][:count]:
                handle.readinto(dest)
    distinct = READ_PASSES * count * block / (time.perf_counter() - started) / GB
    parallel = parallel_reads(path, block, key_set[2][:count], default_threads())
    path.unlink()
    return {
        "SET": write_one,
        "GET": read,
        "SET_distinct": write_distinct,
        "GET_distinct": distinct,
        "GET_parallel": parallel,
    }


async def timed(run: Callable[[], Awaitable[object]], nbytes: int) -> float:
    started = time.perf_counter()
    await run()
    return nbytes / (time.perf_counter() - started) / GB


async def tier_pass(tier: FileTier, size: str, batch: int, key_set: Blocks) -> dict[str, float]:
    """One SET pass (overwriting) and ``READ_PASSES`` GET passes over the key set, ``batch`` blocks per call
    (GB/s)."""
    block = SIZES[size]
    count = SET_BYTES[size] // block
    keys, data, dests = key_set
    spans = [range(start, min(start + batch, count)) for start in range(0, count, batch)]
    checksums = [payload_checksum(payload) for payload in data]  # as the CPU tier took them at copy time

    async def put() -> None:
        for span in spans:
            chunk = slice(span.start, span.stop)
            assert all(await tier.put(keys[chunk], data[chunk], checksums=checksums[chunk]))

    async def get() -> None:
        for _ in range(READ_PASSES):
            for span in spans:
                assert all(await tier.get_into(keys[span.start : span.stop], dests[span.start : span.stop]))

    write = await timed(put, count * block)
    read = await timed(get, READ_PASSES * count * block)
    assert [bytes(d) for d in dests[:2]] == [bytes(d) for d in data[:2]]
    return {"SET": write, "GET": read}


def summary(size: str, shape: str, op: str, runs: list[dict]) -> dict:
    """One row: medians over the runs of each rate and of the per-run ratios, and the runs themselves."""
    distinct = f"{op}_distinct"
    row = {
        "size": size,
        "shape": shape,
        "op": op,
        "dd_gbps": statistics.median(r["dd"][op] for r in runs),
        "dd_distinct_gbps": statistics.median(r["dd"][distinct] for r in runs),
        "tier_vs_dd_distinct": statistics.median(r["tier"][op] / r["dd"][distinct] for r in runs),
        "tier_gbps": statistics.median(r["tier"][op] for r in runs),
        "tier_vs_dd": statistics.median(r["tier"][op] / r["dd"][op] for r in runs),
        "runs": [{"dd": r["dd"][op], "dd_distinct": r["dd"][distinct], "tier": r["tier"][op]} for r in runs],
    }
    if op == "GET":
        row["reader_threads"] = default_threads()
        row["dd_parallel_gbps"] = statistics.median(r["dd"]["GET_parallel"] for r in runs)
        row["dd_parallel_vs_dd"] = statistics.median(r["dd"]["GET_parallel"] / r["dd"]["GET"] for r in runs)
        row["tier_vs_dd_parallel"] = statistics.median(r["tier"]["GET"] / r["dd"]["GET_parallel"] for r in runs)
        for kept, r in zip(row["runs"], runs, strict=True):
            kept["dd_parallel"] = r["dd"]["GET_parallel"]
    return row


async def measure(directory: Path) -> list[dict]:
    rows = []
    for size, block in SIZES.items():
        count = SET_BYTES[size] // block
        key_set = blocks(count, block)
        for shape, batch in SHAPES[size]:
            tier_dir = directory / f"tier-{size}-{batch}"
            options = FileOptions(path=str(tier_dir), max_bytes=CAPACITY_FACTOR * SET_BYTES[size])
            tier = FileTier(remote_context(block, "file"), options)
            await tier.start()
            runs = []
            try:
                await tier_pass(tier, size, batch, key_set)  # warm: the key set is stored before timing
                for _ in range(RUNS):
                    runs.append(
                        {"dd": dd_pass(directory, size, key_set), "tier": await tier_pass(tier, size, batch, key_set)}
                    )
            finally:
                await tier.close()
                shutil.rmtree(tier_dir, ignore_errors=True)
            rows += [summary(size, f"{shape} ({batch})", op, runs) for op in ("SET", "GET")]
    return rows


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.environ.get("TIERCACHE_BENCH_DIR"), help="where to write (a disk)")
    args = parse(parser)
    if args.quick:
        globals().update(QUICK)
    directory = Path(tempfile.mkdtemp(prefix="tiercache-file-bench-", dir=args.dir))
    load_start = os.getloadavg()
    started = time.perf_counter()
    try:
        filesystem = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True).stdout
        rows = asyncio.run(measure(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    info = {
        "filesystem": filesystem.splitlines()[-1] if filesystem else "",
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "runs": RUNS,
        "runtime_s": time.perf_counter() - started,
    }
    print(f"file tier vs dd-style I/O, median of {RUNS} runs; load {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    threads = default_threads()
    print("dd: one reused buffer (as dd); dd, slots: the same I/O from/into the blocks' distinct buffers;")
    print(f"slots x{threads}: those reads by {threads} threads, as many as the tier reads with (GET only)")
    columns = f"{'dd':>6}  {'dd, slots':>9}  {f'slots x{threads}':>9}  {'tier':>6}  {'tier/dd':>7}  {'tier/slots':>10}"
    print(
        f"{'size':>6} {'shape':<20}{'op':>4}  {columns}  {f'tier/slots x{threads}':>15}  {f'x{threads}/dd':>8}   (GB/s)"
    )
    for r in rows:
        parallel = (
            f"{r['dd_parallel_gbps']:>9.2f}" if "dd_parallel_gbps" in r else f"{'':>9}",
            f"{r['tier_vs_dd_parallel']:>15.2f}  {r['dd_parallel_vs_dd']:>8.2f}" if "dd_parallel_gbps" in r else "",
        )
        print(
            f"{r['size']:>6} {r['shape']:<20}{r['op']:>4}  {r['dd_gbps']:>6.2f}  {r['dd_distinct_gbps']:>9.2f}"
            f"  {parallel[0]}  {r['tier_gbps']:>6.2f}  {r['tier_vs_dd']:>7.2f}  {r['tier_vs_dd_distinct']:>10.2f}"
            f"  {parallel[1]}"
        )
    print(f"wrote {write_result(__file__, {'info': info, 'rows': rows}, args.out, args.quick)}")


if __name__ == "__main__":
    main()
