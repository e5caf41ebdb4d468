"""The region's file: room on its file system made sure of before anything is mapped, a lock each worker holds
while it lives, and files left by processes that ended removed.

- ``reserve``: the region's bytes checked against its file system's free space
  (``RegionSpaceError`` naming the size, the path, ``shared_dir`` and
  ``capacity_bytes``), then allocated with ``posix_fallocate``, which fails with
  ENOSPC where the room went meanwhile. A mapped page no block backs would be a
  SIGBUS in whichever process touched it first (Docker's ``/dev/shm`` is 64 MiB),
  so nothing is mapped before its blocks are allocated.
- ``RegionFile``: each worker opens the file with a shared ``flock`` it holds
  until it closes it or ends, however it ends (the kernel drops the lock;
  process ids and their namespaces play no part). On close, and at its
  process's exit, the worker that created the file removes the name if the
  scheduler side has not taken it yet: the start failed (a worker that joined it
  leaves it: it may be another instance's, refused).
- ``sweep``: a region file no process holds a lock on was left by a start that
  was killed before the scheduler side took it (nothing could remove it then):
  removed at the next start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import weakref
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(f"vllm.{__name__}")

REGION_NAME = re.compile(r"tiercache-.+-dp\d+")
"""A region file's name (``region.region_path``): what ``sweep`` considers."""
SHARED_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")
"""File systems whose files are RAM: a region elsewhere goes through the page cache to a disk."""
OPEN_ATTEMPTS = 8
"""Opens of a region file before giving up, each undone by a sweep that removed the file between open and lock."""
MIB = 1 << 20
MOUNTINFO = Path("/proc/self/mountinfo")


class RegionError(RuntimeError):
    """The shared region is missing, of another size, or not mapped by every worker."""


class RegionSpaceError(RegionError):
    """The region's file system has no room for it (said at start, before anything is mapped)."""

    def __init__(self, size: int, path: Path, free: int) -> None:
        super().__init__(
            f"tiercache's CPU tier needs {size / MIB:.0f} MiB ({size} bytes) at {path}, but {path.parent} has "
            f"{free / MIB:.0f} MiB ({free} bytes) free: lower the CPU tier's capacity_bytes (or capacity_blocks) in "
            "the topology, or set shared_dir in kv_connector_extra_config to a shared-memory directory with room "
            "(Docker: --shm-size or --ipc=host)")


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still allocate on ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def filesystem(directory: Path, mountinfo: Path = MOUNTINFO) -> str | None:
    """The type of the file system ``directory`` is on (``tmpfs``, ``ext4``, ...), None where it cannot be told."""
    resolved = os.path.realpath(directory)
    best, kind = "", None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[fields.index("-") + 1]
    return kind


def reserve(fd: int, path: Path, size: int, free_space: Callable[[Path], int] = free_bytes) -> None:
    """Make the file ``size`` bytes, every one backed (``RegionSpaceError`` where the file system has no room)."""
    stats = os.fstat(fd)
    if stats.st_size > size:
        raise RegionError(f"{path} has {stats.st_size} bytes, more than this instance's CPU tier ({size}): another "
                          "vLLM instance of the same engine_id and data-parallel rank uses it; give each its own "
                          "engine_id in --kv-transfer-config")
    needed = size - min(size, stats.st_blocks * 512)  # st_blocks counts 512-byte units
    available = free_space(path.parent)
    if needed > available:
        raise RegionSpaceError(size, path, available)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RegionSpaceError(size, path, free_space(path.parent)) from error
        raise


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    opened = os.fstat(fd)
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _remove_unclaimed(path: Path, fd: int, pid: int, created: bool) -> None:
    """Close ``fd``; if this process created the file and ``path`` still names it (the scheduler side never took
    it), unlink it first. In the process that opened it only (a forked child inherits finalizers, not the file)."""
    if os.getpid() != pid:
        return
    try:
        if created and _names(path, fd):
            path.unlink()
            log.warning("tiercache connector: removed %s, which the scheduler side never took (the start failed)",
                        path)
    finally:
        os.close(fd)


class RegionFile:
    """A region file a worker holds open with a shared lock (see the module docstring)."""

    def __init__(self, path: Path, fd: int, created: bool) -> None:
        self.path, self.fd, self.created = path, fd, created
        self._finalizer = weakref.finalize(self, _remove_unclaimed, path, fd, os.getpid(), created)

    @classmethod
    def open(cls, path: Path) -> RegionFile:
        """Open ``path`` (created if missing) with the lock held, after a sweep of its directory."""
        sweep(path.parent)
        for _ in range(OPEN_ATTEMPTS):
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                try:
                    fd, created = os.open(path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweep holds the file
            if _names(path, fd):
                return cls(path, fd, created)
            os.close(fd)  # swept between the open and the lock: open again
        raise RegionError(f"{path} was removed {OPEN_ATTEMPTS} times while it was being opened")

    def close(self) -> None:
        """Release the lock; the name goes too if the scheduler side never took it."""
        self._finalizer()


def sweep(directory: Path) -> list[Path]:
    """Remove the region files in ``directory`` no process holds (left by starts killed before the scheduler side
    took them); the paths removed."""
    removed = []
    for path in sorted(directory.iterdir()):
        if not REGION_NAME.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _names(path, fd):
                size = os.fstat(fd).st_size
                path.unlink()
                removed.append(path)
                log.warning("tiercache connector: removed %s (%.0f MiB), a CPU tier region no running process holds "
                            "(a start killed before its scheduler side took it)", path, size / MIB)
        except BlockingIOError:
            pass  # held: a live instance's
        finally:
            os.close(fd)
    return removed
