"""The file tier next to dd-style sequential I/O of the same bytes on the same disk, in one run.

For 64 KiB and 2 MiB blocks: a dd-style ceiling (one file, block-sized
``write``/``readinto`` calls, no validation) and the tier (``put`` /
``get_into`` with header, checksum and index; every SET pass overwrites the
same keys, so the segments fill and GC runs as in steady state; each block's
checksum is carried, as the manager's puts carry the one taken when the block
was copied into the CPU tier). Two tier
shapes: one call for the whole set, and transfer-queue-sized batches. Each of
``RUNS`` runs measures the ceiling and the tier back to back (interleaved); the
table shows medians over the runs of the rates and of the per-run ratios, with
the load average (a shared 2-core machine moves 15-30% between runs). Prints a
table and writes ``file_tier.json`` next to this script.

    python benchmarks/file_tier.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
from common import write_result

from tiercache.blocks.codec import payload_checksum
from tiercache.testing.redis_servers import remote_context, slot_views
from tiercache.tiers.file import FileOptions, FileTier

SIZES = {"64KiB": 64 * 1024, "2MiB": 2 * 1024 * 1024}
SET_BYTES = {"64KiB": 64 * 2**20, "2MiB": 128 * 2**20}
"""Bytes moved per timed pass (the whole key set)."""
QUEUE_BATCH = {"64KiB": 64, "2MiB": 16}
"""Blocks per tier call in the batched shape (what a transfer-queue batch carries)."""
CAPACITY_FACTOR = 3
"""The tier's max_bytes as a multiple of the key set: overwrites fill it and GC runs."""
RUNS = 5
READ_PASSES = 8
"""Reads of the whole key set per timed GET (dd's and the tier's alike): one read of 128 MiB lasts ~13 ms
here, too short a window on a shared machine."""
GB = 1e9


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


def dd_pass(directory: Path, size: str, key_set: Blocks) -> dict[str, float]:
    """One sequential write then ``READ_PASSES`` reads of ``SET_BYTES`` in block-sized calls (GB/s).

    ``SET`` writes one buffer over and over and ``GET`` reads into one reused
    buffer, as ``dd`` does (the buffer stays in the CPU's cache); ``SET_distinct``
    writes the key set's distinct payloads and ``GET_distinct`` reads into its
    distinct destinations, as a store and a load must (each block has its own
    slot): the ceilings for any writer and reader of real blocks.
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
    path.unlink()
    return {"SET": write_one, "GET": read, "SET_distinct": write_distinct, "GET_distinct": distinct}


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


async def measure(directory: Path) -> list[dict]:
    rows = []
    for size, block in SIZES.items():
        count = SET_BYTES[size] // block
        key_set = blocks(count, block)
        for shape, batch in (("whole set", count), ("queue batch", QUEUE_BATCH[size])):
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
            for op in ("SET", "GET"):
                distinct = f"{op}_distinct"
                rows.append(
                    {
                        "size": size,
                        "shape": f"{shape} ({batch})",
                        "op": op,
                        "dd_gbps": statistics.median(r["dd"][op] for r in runs),
                        "dd_distinct_gbps": statistics.median(r["dd"][distinct] for r in runs),
                        "tier_vs_dd_distinct": statistics.median(r["tier"][op] / r["dd"][distinct] for r in runs),
                        "tier_gbps": statistics.median(r["tier"][op] for r in runs),
                        "tier_vs_dd": statistics.median(r["tier"][op] / r["dd"][op] for r in runs),
                        "runs": [
                            {"dd": r["dd"][op], "dd_distinct": r["dd"][distinct], "tier": r["tier"][op]} for r in runs
                        ],
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.environ.get("TIERCACHE_BENCH_DIR"), help="where to write (a disk)")
    args = parser.parse_args()
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
    print("dd: one reused buffer (as dd); dd, slots: the same I/O from/into the blocks' distinct buffers")
    columns = f"{'dd':>6}  {'dd, slots':>9}  {'tier':>6}  {'tier/dd':>7}  {'tier/slots':>10}"
    print(f"{'size':>6} {'shape':<18}{'op':>4}  {columns}   (GB/s)")
    for r in rows:
        print(
            f"{r['size']:>6} {r['shape']:<18}{r['op']:>4}  {r['dd_gbps']:>6.2f}  {r['dd_distinct_gbps']:>9.2f}"
            f"  {r['tier_gbps']:>6.2f}  {r['tier_vs_dd']:>7.2f}  {r['tier_vs_dd_distinct']:>10.2f}"
        )
    print(f"wrote {write_result(__file__, {'info': info, 'rows': rows})}")


if __name__ == "__main__":
    main()
