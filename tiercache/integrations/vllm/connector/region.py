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

A worker whose KV layout the connector cannot map (``pages``) declines instead:
it writes only the header, marks its rank declined with the reason, and the
scheduler side then declines every request (``RegionDeclined``) rather than
stop vLLM from serving.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

MAGIC = b"TCREGN01"
"""The first bytes of a region's header."""
HEADER_BYTES = 4096
"""The header: the magic, then one byte per rank that has mapped the region."""
RANKS_AT = 64
"""Where the ranks' bytes start in the header."""
MAPPED, DECLINED = 1, 2
"""A rank's byte: it mapped the region, or it declined (its reason at ``REASON_AT``)."""
REASON_AT = 1024
"""Where a declining worker's reason starts in the header (UTF-8, NUL-padded)."""


class RegionError(RuntimeError):
    """The shared region is missing, of another size, or not mapped by every worker."""


class RegionDeclined(RegionError):
    """A worker declined (a KV layout it cannot map): the message is its reason."""


def region_path(shared_dir: Path, engine_id: str, dp_rank: int) -> Path:
    """The region's file for one vLLM instance (its ``engine_id``) and data-parallel rank."""
    return Path(shared_dir) / f"tiercache-{engine_id}-dp{dp_rank}"


class SharedRegion:
    """A header and ``num_slots`` slots of ``slot_bytes``, mapped from a file (see the module docstring)."""

    def __init__(self, path: Path, num_slots: int, slot_bytes: int, *, create: bool) -> None:
        self.path = Path(path)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = HEADER_BYTES + num_slots * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise RegionError(f"tiercache's shared CPU tier {self.path} is missing: vLLM's workers create it when "
                              "they register their KV caches, before the scheduler starts") from None
        try:
            current = os.fstat(fd).st_size
            if create and current < size:
                os.ftruncate(fd, size)
            elif current != size and not create:
                raise RegionError(f"{self.path} has {current} bytes; this topology's CPU tier needs {size}")
            # populated at once: a remote read or a copy landing in a slot never pays its pages' first-touch faults
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.header = buffer[:HEADER_BYTES]
        self.slots = buffer[HEADER_BYTES:].view(num_slots, slot_bytes)
        """``[num_slots, slot_bytes]`` uint8: slot ``i`` is row ``i``."""

    @classmethod
    def for_worker(cls, path: Path, num_slots: int, slot_bytes: int, rank: int) -> SharedRegion:
        """Create (or open) and map the region, and mark ``rank`` as mapped."""
        region = cls(path, num_slots, slot_bytes, create=True)
        region.header[: len(MAGIC)] = torch.frombuffer(bytearray(MAGIC), dtype=torch.uint8)
        region.header[RANKS_AT + rank] = MAPPED
        return region

    @staticmethod
    def decline(path: Path, rank: int, reason: str) -> None:
        """Mark ``rank`` declined with ``reason`` in the region's header (the file made header-only if new)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < HEADER_BYTES:
                os.ftruncate(fd, HEADER_BYTES)
            os.pwrite(fd, MAGIC, 0)
            os.pwrite(fd, bytes([DECLINED]), RANKS_AT + rank)
            text = reason.encode()[: HEADER_BYTES - REASON_AT - 1]
            os.pwrite(fd, text + bytes(HEADER_BYTES - REASON_AT - len(text)), REASON_AT)
        finally:
            os.close(fd)

    @classmethod
    def for_scheduler(cls, path: Path, num_slots: int, slot_bytes: int, world: int) -> SharedRegion:
        """Map the region the workers made, check every rank mapped it, and unlink its name (``RegionDeclined``: a
        worker declined)."""
        _raise_if_declined(path)
        region = cls(path, num_slots, slot_bytes, create=False)
        if bytes(region.header[: len(MAGIC)].tolist()) != MAGIC:
            raise RegionError(f"{path} is not a tiercache region")
        missing = [rank for rank in range(world) if not int(region.header[RANKS_AT + rank])]
        if missing:
            raise RegionError(f"{path}: ranks {missing} of {world} did not map tiercache's CPU tier")
        path.unlink(missing_ok=True)
        return region


def _raise_if_declined(path: Path) -> None:
    """``RegionDeclined`` with the worker's reason when a rank declined (the name is unlinked then)."""
    try:
        with open(path, "rb") as file:
            header = file.read(HEADER_BYTES)
    except FileNotFoundError:
        return  # reported as missing by the mapping
    if header[: len(MAGIC)] != MAGIC or DECLINED not in header[RANKS_AT:REASON_AT]:
        return
    path.unlink(missing_ok=True)
    raise RegionDeclined(header[REASON_AT:].rstrip(b"\0").decode(errors="replace"))
