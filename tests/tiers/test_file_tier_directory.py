"""The file tier's directory: a bound far below the segment size, several writers, and odd entries.

Issue 20 item 9: with a bound below 64 MiB x writers, each writer's open segment was never closed and
GC skipped open segments, so the tier filled once and then refused every write; a directory, an
unreadable file or a FIFO named like a segment broke puts or blocked the process for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from support import module_command, with_tests_on_path
from support.file_tier_helpers import BLOCK, RECORD, directory_bytes, open_tier, run_writers

from tiercache.blocks.codec import Codec
from tiercache.testing.redis_servers import empty_dests, random_blocks, remote_context
from tiercache.tiers.base import Presence
from tiercache.tiers.file.records import ALIGNED, RecordKind

HANG_GUARD_S = 120.0
"""How long the child may run before it counts as blocked (a hang guard, far above its usual second or two)."""
ODD_NAME = "odd-entry.000001.seg"
"""Named like a segment (``<writer>.<seq>.seg``), so only its type or content tells it apart."""
LONG_AGO = 1_000_000_000.0
"""An mtime in 2001: the odd entry is the least recently used thing in the directory, first in GC's way."""


async def test_a_bound_below_the_segment_size_keeps_admitting_with_several_writers(tmp_path) -> None:
    """Before: 4 writers under 2 MiB with 64 MiB segments admitted 60-odd blocks, then none, round after round."""
    writers, rounds, batch, batches_per_writer = 4, 5, 10, 5
    max_bytes = 2 << 20
    tiers = [await open_tier(tmp_path, max_blocks=None, max_bytes=max_bytes) for _ in range(writers)]
    try:
        admitted, seed = [], 0
        for _ in range(rounds):
            stored = 0
            for _ in range(batches_per_writer):
                for tier in tiers:
                    seed += 1
                    keys, payloads = random_blocks(batch, BLOCK, seed=seed)
                    stored += sum(await tier.put(keys, payloads))
                    assert directory_bytes(tmp_path) <= max_bytes
            admitted.append(stored)
        offered = writers * batches_per_writer * batch
        assert admitted == [offered] * rounds, f"blocks admitted per round of {offered}: {admitted}"
        out = empty_dests(batch, BLOCK)
        assert await tiers[0].get_into(keys, out) == [True] * batch  # the last batch, written by the last writer
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
        assert sum(tier.stats()["gc_removed_segments"] for tier in tiers) > 0
    finally:
        for tier in tiers:
            await tier.close()


def test_processes_with_the_default_segment_size_keep_admitting(tmp_path) -> None:
    """Four processes, default segments (64 MiB), a bound of 60 blocks: every batch finds room after GC."""
    max_bytes, writers, batches, batch = 60 * RECORD, 4, 12, 5
    stored, peak = run_writers(tmp_path, max_bytes, writers, batches, batch, segment_bytes=0)
    assert stored == [batches * batch] * writers, f"blocks stored per writer of {batches * batch}: {stored}"
    assert peak <= max_bytes, f"peak {peak / max_bytes:.2f}x the bound"


def make_directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x" * 4096)


def make_garbage_file(path: Path) -> None:
    """A file this tier cannot read: not readable (when not root) and not a segment inside either."""
    path.write_bytes(os.urandom(3 * RECORD))
    path.chmod(0)


def make_dangling_symlink(path: Path) -> None:
    path.symlink_to(path.parent.parent / "nowhere.seg")


ODD_ENTRIES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "directory": (ODD_NAME, make_directory),
    "fifo": (ODD_NAME, os.mkfifo),
    "unreadable file": (ODD_NAME, make_garbage_file),
    "dangling symlink": (ODD_NAME, make_dangling_symlink),
    "name it cannot parse": ("notes.seg", lambda path: path.write_bytes(os.urandom(3 * RECORD))),
}


@pytest.mark.parametrize("kind", list(ODD_ENTRIES))
def test_an_odd_entry_is_skipped_counted_logged_once_and_never_blocks(tmp_path, kind: str) -> None:
    directory = tmp_path / "tier"
    directory.mkdir()
    name, make = ODD_ENTRIES[kind]
    odd = directory / name
    make(odd)
    os.utime(odd, (LONG_AGO, LONG_AGO), follow_symlinks=False)
    kept = os.lstat(odd)
    command = module_command("file_tier_odd_entries", str(directory), "12")
    env = with_tests_on_path()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = child.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"the tier blocked on a {kind} named {name} (killed after {HANG_GUARD_S:.0f} s)")
    assert child.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["stored"] == result["offered"], (result, stderr[-2000:])
    assert result["intact"] == result["offered"], (result, stderr[-2000:])
    assert result["unknown"] == 0, (result, stderr[-2000:])  # the tier could always tell what it holds
    assert odd.is_symlink() or odd.exists(), "the tier removed an entry it cannot judge"
    after = os.lstat(odd)
    assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(kept.st_mode), kept.st_ino)
    assert result["stats"].get("skipped_entries") == 1, result["stats"]
    assert sum(name in line for line in stderr.splitlines()) == 1, stderr[-2000:]  # logged once


async def test_a_segment_whose_first_batch_is_still_being_written_is_not_skipped(tmp_path) -> None:
    """A reservation is zeros until its batch lands: that is another writer's segment in flight, not an odd file."""
    tier = await open_tier(tmp_path)
    try:
        keys, payloads = random_blocks(1, BLOCK)
        value = Codec(remote_context(BLOCK).codec.fingerprint).encode_value(keys[0], payloads[0])
        segment = tmp_path / "other-writer.000001.seg"
        segment.write_bytes(bytes(RECORD))  # reserved, nothing written yet
        await tier.gc()
        assert await tier.contains(keys) == [Presence.ABSENT]
        with open(segment, "r+b") as handle:  # the batch lands: body, then its record header
            handle.write(ALIGNED.record(RecordKind.VALUE, keys[0], 1, value))
        out = empty_dests(1, BLOCK)
        assert await tier.get_into(keys, out) == [True]
        assert bytes(out[0]) == bytes(payloads[0])
        assert "skipped_entries" not in tier.stats()
    finally:
        await tier.close()


async def test_a_read_while_the_process_is_out_of_descriptors_misses_and_the_segment_serves_afterwards(
    tmp_path,
) -> None:
    """Too many open files is the process's state, not the entry's: the read misses, nothing is skipped, and the
    same segment serves once descriptors are free again."""
    tier = await open_tier(tmp_path)
    reader = await open_tier(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        keys, payloads = random_blocks(4, BLOCK)
        assert await tier.put(keys, payloads) == [True] * 4
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        assert await reader.get_into(keys, empty_dests(4, BLOCK)) == [False] * 4
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        out = empty_dests(4, BLOCK)
        assert await reader.get_into(keys, out) == [True] * 4
        assert [bytes(view) for view in out] == [bytes(payload) for payload in payloads]
        assert reader.stats().get("skipped_entries", 0) == 0
    finally:
        await tier.close()
        await reader.close()
