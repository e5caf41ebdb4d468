"""The CPU tier's memory, shared between vLLM's scheduler process and its workers: a file in shared memory.

vLLM runs its scheduler (where tiercache's bookkeeping and remote I/O live) and
its workers (which own the KV tensors) in separate processes. The CPU tier's
slots are one file under ``shared_dir`` (``/dev/shm``: RAM) that each of them
maps: a worker copies its rank's pages of a block into a slot or out of it, the
scheduler side reads a slot into a remote or a remote into a slot. Workers create
and map the file when they register their KV caches, which vLLM does before it
builds its scheduler; each marks its rank in the header. The scheduler side then
maps it, checks that every rank is there (else it refuses to start: a worker
mapping another file would copy into memory no one reads), and unlinks the name,
so the memory goes when the last process does, however they end.

Before a worker maps anything the file's blocks are allocated, after a check of
its file system's free space (``shmfile``: a clear error at start, never a SIGBUS
later); a ``shared_dir`` that is not shared memory is said in the log. Until the
scheduler side has taken the file, the workers hold it (``shmfile.RegionFile``):
a start that fails in between leaves nothing behind (the workers remove the name
when they close or exit, and a start killed outright leaves a file no one holds,
removed by the next start's sweep). Any error of the scheduler side's removes
the name too: that instance will not start.

A worker whose KV layout the connector cannot map (``pages``) declines instead:
it writes only the header, marks its rank declined with the reason, and the
scheduler side then declines every request (``RegionDeclined``) rather than
stop vLLM from serving.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch

from tiercache.integrations.vllm.connector.shmfile import (
    SHARED_MEMORY_FILESYSTEMS,
    RegionError,
    RegionFile,
    RegionSpaceError,
    filesystem,
    free_bytes,
    reserve,
)

__all__ = ["RegionDeclined", "RegionError", "RegionSpaceError", "SharedRegion", "region_path"]

log = logging.getLogger(f"vllm.{__name__}")

MAGIC = b"TCREGN01"
"""The first bytes of a region's header."""
HEADER_BYTES = max(4096, mmap.PAGESIZE)
"""The header: the magic, then one byte per rank that has mapped the region; whole pages, so the slots start on a
page (registrations end on page boundaries, ``pinning``)."""
RANKS_AT = 64
"""Where the ranks' bytes start in the header."""
MAPPED, DECLINED = 1, 2
"""A rank's byte: it mapped the region, or it declined (its reason at ``REASON_AT``)."""
REASON_AT = 1024
"""Where a declining worker's reason starts in the header (UTF-8, NUL-padded)."""
MAX_RANKS = REASON_AT - RANKS_AT
"""Ranks a header has bytes for."""
REASON_BYTES = 4096 - REASON_AT
"""Room for a declining worker's reason."""


class RegionDeclined(RegionError):
    """A worker declined (a KV layout it cannot map): the message is its reason."""


def region_path(shared_dir: Path, engine_id: str, dp_rank: int) -> Path:
    """The region's file for one vLLM instance (its ``engine_id``) and data-parallel rank."""
    return Path(shared_dir) / f"tiercache-{engine_id}-dp{dp_rank}"


class SharedRegion:
    """A header and ``num_slots`` slots of ``slot_bytes``, mapped from a file (see the module docstring)."""

    def __init__(self, path: Path, num_slots: int, slot_bytes: int, fd: int, held: RegionFile | None = None) -> None:
        self.path = Path(path)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.held = held
        """The worker's hold on the file until the scheduler side has taken it (None: the scheduler side's)."""
        # populated at once: a remote read or a copy landing in a slot never pays its pages' first-touch faults
        self._map = mmap.mmap(fd, self.size(num_slots, slot_bytes),
                              flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.header = buffer[:HEADER_BYTES]
        self.slots = buffer[HEADER_BYTES:].view(num_slots, slot_bytes)
        """``[num_slots, slot_bytes]`` uint8: slot ``i`` is row ``i``."""

    @staticmethod
    def size(num_slots: int, slot_bytes: int) -> int:
        return HEADER_BYTES + num_slots * slot_bytes

    @classmethod
    def for_worker(cls, path: Path, num_slots: int, slot_bytes: int, rank: int,
                   free_space: Callable[[Path], int] = free_bytes) -> SharedRegion:
        """Create (or open) the region with its every byte allocated, map it and mark ``rank`` as mapped
        (``RegionSpaceError``: its file system has no room; nothing is left behind)."""
        path = Path(path)
        if rank >= MAX_RANKS:
            raise RegionError(f"tiercache's CPU tier region has room for {MAX_RANKS} ranks, not rank {rank}")
        held = RegionFile.open(path)
        try:
            if held.created:
                _say_if_not_shared_memory(path.parent)
            reserve(held.fd, path, cls.size(num_slots, slot_bytes), free_space)
            region = cls(path, num_slots, slot_bytes, held.fd, held)
            if int(region.header[RANKS_AT + rank]) == MAPPED:
                raise RegionError(f"{path}: rank {rank} of another running vLLM instance maps it; give each instance "
                                  "its own engine_id in --kv-transfer-config")
            region.header[: len(MAGIC)] = torch.frombuffer(bytearray(MAGIC), dtype=torch.uint8)
            region.header[RANKS_AT + rank] = MAPPED
        except BaseException:
            held.close()
            raise
        return region

    @staticmethod
    def decline(path: Path, rank: int, reason: str, held: RegionFile | None = None) -> RegionFile:
        """Mark ``rank`` declined with ``reason`` in the region's header (the file made header-only if new; ``held``:
        the file this worker holds already); the hold on the file, for the worker to keep until it closes."""
        held = held if held is not None else RegionFile.open(Path(path))
        try:
            if os.fstat(held.fd).st_size < HEADER_BYTES:
                os.posix_fallocate(held.fd, 0, HEADER_BYTES)
            os.pwrite(held.fd, MAGIC, 0)
            os.pwrite(held.fd, bytes([DECLINED]), RANKS_AT + rank)
            text = reason.encode()[: REASON_BYTES - 1]
            os.pwrite(held.fd, text + bytes(REASON_BYTES - len(text)), REASON_AT)
        except BaseException:
            held.close()
            raise
        return held

    @classmethod
    def for_scheduler(cls, path: Path, num_slots: int, slot_bytes: int, world: int) -> SharedRegion:
        """Map the region the workers made, check every rank mapped it, and unlink its name (``RegionDeclined``: a
        worker declined; on any error the name is unlinked too: the instance does not start)."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RegionError(f"tiercache's shared CPU tier {path} is missing: vLLM's workers create it when they "
                              "register their KV caches, before the scheduler starts") from None
        try:
            _raise_if_declined(fd)
            size = cls.size(num_slots, slot_bytes)
            current = os.fstat(fd).st_size
            if current != size:
                raise RegionError(f"{path} has {current} bytes; this topology's CPU tier needs {size}")
            region = cls(path, num_slots, slot_bytes, fd)
            if bytes(region.header[: len(MAGIC)].tolist()) != MAGIC:
                raise RegionError(f"{path} is not a tiercache region")
            missing = [rank for rank in range(world) if int(region.header[RANKS_AT + rank]) != MAPPED]
            if missing:
                raise RegionError(f"{path}: ranks {missing} of {world} did not map tiercache's CPU tier")
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return region

    def close(self) -> None:
        """Give up the worker's hold on the file (the name goes if the scheduler side never took it)."""
        if self.held is not None:
            self.held.close()


def _raise_if_declined(fd: int) -> None:
    """``RegionDeclined`` with the worker's reason when a rank declined."""
    header = os.pread(fd, HEADER_BYTES, 0)
    if header[: len(MAGIC)] == MAGIC and DECLINED in header[RANKS_AT:REASON_AT]:
        raise RegionDeclined(header[REASON_AT : REASON_AT + REASON_BYTES].rstrip(b"\0").decode(errors="replace"))


def _say_if_not_shared_memory(directory: Path) -> None:
    """A warning where ``shared_dir`` is on a disk's file system (the CPU tier would go through the page cache)."""
    kind = filesystem(directory)
    if kind is None:
        log.info("tiercache connector: cannot tell which file system shared_dir %s is on", directory)
    elif kind not in SHARED_MEMORY_FILESYSTEMS:
        log.warning("tiercache connector: shared_dir %s is on %s, not shared memory (%s): the CPU tier's pages go "
                    "through the page cache to its disk; set shared_dir to /dev/shm or another tmpfs", directory,
                    kind, ", ".join(SHARED_MEMORY_FILESYSTEMS))
