"""Shared pieces of the file-tier tests: a tier on a directory, its size, a watcher, writer processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from support import module_command, with_tests_on_path
from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.testing.redis_servers import remote_context
from tiercache.tiers.file import FileOptions, FileTier
from tiercache.tiers.file.capacity import DirectoryLock, SegmentFile, list_segments
from tiercache.tiers.file.entries import DirectoryEntries
from tiercache.tiers.file.records import ALIGNED

BLOCK = 32 * 1024
RECORD = ALIGNED.span(HEADER_SIZE + BLOCK)
"""Bytes one block's record takes in a segment."""
WATCH_PAUSE_S = 0.0005
"""Pause between a watcher's measurements, so it does not hog the directory lock the writers need."""
GATE_POLL_S = 0.005
"""Pause between looks for the writers' ready files (a gate, not a timing assumption)."""


async def open_tier(path: os.PathLike, **options: object) -> FileTier:
    tier = FileTier(remote_context(BLOCK), FileOptions(path=str(path), **{"max_blocks": 1000, **options}))
    await tier.start()
    return tier


def segments_in(path: Path) -> list[SegmentFile]:
    """The segment files in ``path`` as a tier there sees them."""
    return list_segments(DirectoryEntries(Path(path), Counter()))


def directory_bytes(path: Path) -> int:
    return sum(segment.size for segment in segments_in(path))


@contextlib.contextmanager
def watching(path: Path) -> Iterator[list[int]]:
    """A thread measuring the directory under its lock (a consistent snapshot) until the block ends."""
    peak = [0]
    stop = threading.Event()
    lock = DirectoryLock(path)

    def watch() -> None:
        while not stop.wait(WATCH_PAUSE_S):
            with lock.held():
                peak[0] = max(peak[0], directory_bytes(path))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        lock.close()
        peak[0] = max(peak[0], directory_bytes(path))


def run_writers(
    tmp_path: Path, max_bytes: int, writers: int, batches: int, batch: int, segment_bytes: int = -1
) -> tuple[list[int], int]:
    """``writers`` processes (file_tier_writer.py) writing into one directory at once: blocks each stored, peak."""
    directory = tmp_path / "tier"
    directory.mkdir()
    command = module_command("file_tier_writer", str(directory), str(max_bytes), str(batches))
    procs = [
        subprocess.Popen(
            [*command, str(batch), str(seed), str(segment_bytes)],
            stdout=subprocess.PIPE,
            text=True,
            env=with_tests_on_path(),
        )
        for seed in range(1, writers + 1)
    ]
    try:
        while len(list(tmp_path.glob("ready-*"))) < writers:
            assert all(proc.poll() is None for proc in procs), "a writer died before the gate"
            time.sleep(GATE_POLL_S)
        with watching(directory) as peak:
            (tmp_path / "go").touch()
            outputs = [proc.communicate()[0] for proc in procs]
        assert all(proc.returncode == 0 for proc in procs)
        return [int(out) for out in outputs], peak[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
