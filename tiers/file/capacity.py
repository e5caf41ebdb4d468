"""Capacity of a shared tier directory: one lock across processes, usage measured, GC by segment.

Every writer (thread, process or host on the mount) reserves the bytes of a
batch while holding the directory lock (``fcntl.flock`` on ``<path>/.lock``):
it measures the directory (the sizes of all segment files), frees the least
recently used segments if the batch would go over the bound, and extends its
own segment by the batch's size (``posix_fallocate``, so a full disk says so
before anything is written) before letting go. A reservation is therefore
visible to every other writer's measurement at once, and the directory never
holds more than the bound. A segment some writer is still appending to is held
while a batch is being written into it (a shared ``flock``, from its reservation until the batch is
written) is never removed; GC takes an exclusive one first. Between batches, every segment is fair game,
a writer's newest one too (the writer starts a new one at its next reservation), so writers that went
quiet never pin the directory full. Only segments count (``entries``): anything else there is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.tiers.file.entries import LOCK_NAME, SEGMENT_SUFFIX, DirectoryEntries, open_regular

LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""The lock file is opened without following a symlink or waiting on a FIFO (``flock`` itself still waits)."""


@dataclass(frozen=True)
class SegmentFile:
    """One segment file as the directory listing saw it."""

    name: str
    path: str
    size: int
    mtime: float


@dataclass
class Freed:
    """What one GC pass removed."""

    segments: list[str] = field(default_factory=list)
    bytes: int = 0
    expired: int = 0


def list_segments(entries: DirectoryEntries) -> list[SegmentFile]:
    """The segment files of ``entries``' directory (files vanishing meanwhile, and whatever is not a segment,
    are skipped)."""
    found = []
    for entry in entries.segments():
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        found.append(SegmentFile(entry.name, entry.path, info.st_size, info.st_mtime))
    return found


class SegmentSizes:
    """Sizes of a directory's segments, statting only the ones that may still grow.

    A writer appends only to its newest segment (``<writer>.<seq>.seg``) and
    reserves (extends) a batch's bytes before it ever rolls to the next one, so
    once a later sequence of the same writer exists, a segment's size is final:
    it is remembered and not statted again. Each call costs one directory
    listing plus one ``stat`` per writer (its newest segment), not one per segment.
    """

    def __init__(self, entries: DirectoryEntries) -> None:
        self.root = entries.root
        self.entries = entries
        self._final: dict[str, int] = {}
        self._lock = threading.Lock()

    def current(self) -> dict[str, int]:
        """Segment name -> size, for every segment present now."""
        names = [entry.name for entry in self.entries.segments()]
        parts = {name: _writer_and_sequence(name) for name in names}
        newest: dict[str, int] = {}
        for writer, sequence in parts.values():
            newest[writer] = max(newest.get(writer, sequence), sequence)
        with self._lock:
            final = {name: size for name, size in self._final.items() if name in parts}
        sizes = {}
        for name, (writer, sequence) in parts.items():
            if name in final:
                sizes[name] = final[name]
                continue
            try:
                sizes[name] = os.stat(os.path.join(self.root, name), follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            if sequence < newest[writer]:
                final[name] = sizes[name]
        with self._lock:
            self._final = final
        return sizes


def _writer_and_sequence(name: str) -> tuple[str, int]:
    """``<writer>.<seq>.seg`` -> (writer, sequence)."""
    writer, _, sequence = name[: -len(SEGMENT_SUFFIX)].rpartition(".")
    return writer, int(sequence)


class DirectoryLock:
    """The capacity lock of one directory: a thread lock plus an exclusive ``flock``."""

    def __init__(self, root: Path) -> None:
        self._path = root / LOCK_NAME
        self._thread_lock = threading.Lock()
        self._fd: int | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock (blocking; call from a worker thread)."""
        with self._thread_lock:
            if self._fd is None:
                self._fd = os.open(self._path, LOCK_FLAGS, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the lock file."""
        with self._thread_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def try_remove(path: str) -> bool:
    """Remove a segment unless a batch is being written into it (its shared ``flock``); True if removed."""
    try:
        fd = open_regular(path)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def free_down_to(segments: list[SegmentFile], usage: int, target: int, freed: Freed) -> int:
    """Remove least recently used segments until usage <= ``target``; return the new usage."""
    for segment in sorted(segments, key=lambda s: s.mtime):
        if usage <= target:
            break
        if try_remove(segment.path):
            usage -= segment.size
            freed.segments.append(segment.name)
            freed.bytes += segment.size
    return usage


def expire(segments: list[SegmentFile], older_than: float, freed: Freed) -> list[SegmentFile]:
    """Remove segments last used before ``older_than`` (epoch seconds); return the rest."""
    kept = []
    for segment in segments:
        if segment.mtime < older_than and try_remove(segment.path):
            freed.segments.append(segment.name)
            freed.bytes += segment.size
            freed.expired += 1
        else:
            kept.append(segment)
    return kept


def reserve_space(fd: int, offset: int, length: int) -> None:
    """Extend a segment by ``length`` bytes at ``offset``, allocating the disk space now.

    Raises ``OSError(ENOSPC)`` when the disk is full. File systems without
    ``fallocate`` get a plain size extension (a full disk then shows as a failed write).
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, max(offset + length, os.fstat(fd).st_size))
