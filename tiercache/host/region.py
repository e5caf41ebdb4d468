"""The host server's CPU tier: one file in shared memory that the server creates and every engine maps.

The header says what the file is (``MAGIC``, the slot size and count, and the
server's ``token``, new at each start); an engine that maps it checks all of
it, and the file's size, against what the server said at attach, so a file
another process truncated, overwrote or replaced is refused, never read as KV.
The server holds a shared ``flock`` on the file while it runs and unlinks it
when it stops; a server killed outright leaves a file no one locks, which the
next server's start removes (``sweep``). Engines keep their mapping across an
unlink: a server that restarts makes a new file with a new token, and engines
re-attach to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import struct
from pathlib import Path

import torch

MAGIC = b"TCHOST01"
HEADER = struct.Struct("!8sQQ16s")
"""Magic, slot bytes, slot count, the server's token."""
HEADER_BYTES = max(4096, mmap.PAGESIZE)
"""Whole pages, so every slot starts on a page (CUDA registers whole pages)."""
FILE_PREFIX = "tiercache-host-"
FILE_MODE = 0o660
"""Owner and group: who may attach to the socket may map the region."""


class HostRegionError(RuntimeError):
    """The region is missing, has no room, or is not the one the server announced."""


class HostRegion:
    """``num_slots`` slots of ``slot_bytes`` after a header, mapped from a file (see the module docstring)."""

    def __init__(self, path: Path, fd: int, num_slots: int, slot_bytes: int, token: bytes, owner: bool) -> None:
        self.path, self.num_slots, self.slot_bytes, self.token = path, num_slots, slot_bytes, token
        self._fd = fd if owner else None
        self._map = mmap.mmap(fd, self.size(num_slots, slot_bytes),
                              flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots = buffer[HEADER_BYTES:].view(num_slots, slot_bytes)
        """``[num_slots, slot_bytes]`` uint8: slot ``i`` is row ``i``."""

    @staticmethod
    def size(num_slots: int, slot_bytes: int) -> int:
        return HEADER_BYTES + num_slots * slot_bytes

    @classmethod
    def create(cls, directory: Path, num_slots: int, slot_bytes: int) -> HostRegion:
        """A new region in ``directory``, every byte allocated before it is mapped (no SIGBUS later), after removing
        the files of servers that were killed."""
        directory = Path(directory)
        sweep(directory)
        token = secrets.token_bytes(16)
        path = directory / f"{FILE_PREFIX}{token.hex()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have narrowed it
            fcntl.flock(fd, fcntl.LOCK_SH)
            size = cls.size(num_slots, slot_bytes)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise HostRegionError(f"the host CPU tier needs {size} bytes at {path}, more than {directory} "
                                          "has free: lower the CPU tier's capacity or give --shared-dir room") from None
                raise
            os.pwrite(fd, HEADER.pack(MAGIC, slot_bytes, num_slots, token), 0)
            return cls(path, fd, num_slots, slot_bytes, token, owner=True)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, path: Path, num_slots: int, slot_bytes: int, token: bytes) -> HostRegion:
        """Map the region the server announced, refused unless its size and header are what it said."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as error:
            raise HostRegionError(f"cannot open the host server's region {path}: {error.strerror}") from None
        try:
            current = os.fstat(fd).st_size
            if current != cls.size(num_slots, slot_bytes):
                raise HostRegionError(f"{path} has {current} bytes, not the {cls.size(num_slots, slot_bytes)} the "
                                      "server announced: refused")
            header = HEADER.unpack(os.pread(fd, HEADER.size, 0))
            if header != (MAGIC, slot_bytes, num_slots, token):
                raise HostRegionError(f"{path}'s header is not the one the server announced: refused")
            return cls(path, fd, num_slots, slot_bytes, token, owner=False)
        finally:
            os.close(fd)

    def intact(self) -> bool:
        """Whether the header still says what it said at start (an engine checks before trusting a slot)."""
        return bytes(self._map[: HEADER.size]) == HEADER.pack(MAGIC, self.slot_bytes, self.num_slots, self.token)

    def close(self) -> None:
        """The server's: unlink the name and give up the lock (mappings stay valid where they are)."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def sweep(directory: Path) -> list[Path]:
    """Remove the region files in ``directory`` no server holds (left by servers killed outright)."""
    removed = []
    for path in Path(directory).glob(f"{FILE_PREFIX}*"):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a running server's
                continue
            path.unlink()
            os.close(fd)
            removed.append(path)
    return removed
