"""This process's writer of a tier directory: its segments' lifecycle and the room its batches take.

A writer (one per tier instance: host, process id and a random id) appends to
one segment at a time, ``<writer>.<seq>.seg``, and starts the next past
``segment_bytes`` (at most ``1 / SEGMENTS_PER_BOUND`` of the bound) or when its
segment was removed. A batch's bytes are reserved at the segment's end under
the directory lock (``capacity``): the directory is measured, least recently
used segments are freed first when the batch would go over the bound (or the
disk is full), and the segment is extended before the lock is let go. From its
reservation until its bytes are written the segment is held (a shared
``flock``: GC leaves it alone); a retired segment (full, or after an error)
closes once its last batch is written. GC passes (``gc``) expire by age and free
down to the low watermark under the same lock. Everything here blocks: the tier
calls it from worker threads.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiercache.tiers.file.capacity import (
    DirectoryLock,
    Freed,
    SegmentFile,
    SegmentSizes,
    expire,
    free_down_to,
    list_segments,
    reserve_space,
)
from tiercache.tiers.file.entries import SEGMENT_SUFFIX, DirectoryEntries
from tiercache.tiers.file.index import SegmentIndex
from tiercache.tiers.file.options import FileOptions

WRITER_ID_HEX = 8
"""Random hex digits in a writer's id (host and pid alone repeat across restarts)."""
SEGMENTS_PER_BOUND = 16
"""A segment is at most this fraction of the bound: GC frees whole segments, so a pass removes about what it
needs (a tenth, at the default watermark), and the segments being written hold only a small part of the bound."""


@dataclass
class ActiveSegment:
    """The segment this writer appends to: open, ``end`` bytes reserved."""

    name: str
    fd: int
    end: int = 0
    writers: int = 0
    """Batches reserved here and not yet written: while there are any, the segment is shared-locked
    (GC leaves it alone) and its descriptor stays open."""
    retired: bool = False


class SegmentWriter:
    """Reservations in this writer's segment, the segment's lifecycle, and GC (see the module docstring)."""

    def __init__(
        self,
        entries: DirectoryEntries,
        index: SegmentIndex,
        options: FileOptions,
        bound: int,
        counts: Counter,
        note_error: Callable[[str], None],
    ) -> None:
        self.root: Path = entries.root
        self.entries = entries
        self.index = index
        self.options = options
        self.bound = bound
        self.segment_bytes = min(options.segment_bytes, bound // SEGMENTS_PER_BOUND)
        self.counts = counts
        self.note_error = note_error
        host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())
        self.writer = f"{host}-{os.getpid()}-{uuid.uuid4().hex[:WRITER_ID_HEX]}"
        self.usage = 0
        """The directory's bytes as last measured (by a reservation or a GC pass)."""
        self._seq = 0
        self._active: ActiveSegment | None = None
        self._lock = threading.Lock()
        self._sizes = SegmentSizes(entries)
        self._dirlock = DirectoryLock(self.root)

    def close(self) -> None:
        """Close the segment's descriptor (a shared lock goes with it) and the directory lock."""
        with self._lock:
            if self._active is not None and self._active.fd >= 0:
                os.close(self._active.fd)
            self._active = None
        self._dirlock.close()

    def reserve(self, total: int, blocks: int) -> tuple[ActiveSegment, int] | None:
        """Reserve ``total`` bytes at the end of this writer's segment, within the bound and the disk.

        Returns the segment, held until ``release``, and the offset; None (counted
        per ``blocks``) when the batch does not fit or the disk failed.
        """
        freed = Freed()
        try:
            with self._dirlock.held():
                usage = sum(self._sizes.current().values())
                segments: list[SegmentFile] = []
                if usage + total > self.bound:
                    segments = list_segments(self.entries)
                    usage = sum(segment.size for segment in segments)
                    target = int(self.bound * self.options.gc_low_watermark) - total
                    usage = free_down_to(segments, usage, target, freed)
                if usage + total > self.bound:
                    self.counts["put_full"] += blocks
                    self.usage = usage
                    return None
                active = self._writable(total)
                try:
                    reserve_space(active.fd, active.end, total)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    # The disk is smaller than the bound: free a watermark's worth below what is there.
                    self.counts["gc_nospace"] += 1
                    segments = segments or list_segments(self.entries)
                    target = int(usage * self.options.gc_low_watermark) - total
                    usage = free_down_to([s for s in segments if s.name not in freed.segments], usage, target, freed)
                    active = self._writable(total)  # GC may have taken this writer's own segment
                    try:
                        reserve_space(active.fd, active.end, total)
                    except OSError:
                        self.retire(active)  # this segment may be what fills the disk: let GC take it next time
                        raise
                start = active.end
                active.end += total
                self._hold(active)
                self.usage = usage + total
        except OSError as error:
            self.counts["put_nospace" if error.errno == errno.ENOSPC else "put_io_error"] += blocks
            self.note_error(f"put: {error}")
            return None
        finally:
            self._record_freed(freed)
        return active, start

    def _writable(self, incoming: int) -> ActiveSegment:
        """This writer's segment with room for ``incoming`` bytes (a new one if full or removed)."""
        active = self._active
        if active is not None and (
            (active.end and active.end + incoming > self.segment_bytes) or os.fstat(active.fd).st_nlink == 0
        ):
            self.retire(active)
            active = None
        if active is None:
            self._seq += 1
            name = f"{self.writer}.{self._seq:06d}{SEGMENT_SUFFIX}"
            fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            self.index.add_own(name)
            active = self._active = ActiveSegment(name, fd)
        return active

    def retire(self, active: ActiveSegment) -> None:
        """Stop appending to a segment (full, or after an error); close it once its writers finish."""
        with self._lock:
            active.retired = True
            if self._active is active:
                self._active = None
            if active.writers == 0 and active.fd >= 0:
                os.close(active.fd)
                active.fd = -1

    def _hold(self, active: ActiveSegment) -> None:
        """A batch is reserved in ``active`` (under the directory lock): GC must leave it until it is written."""
        with self._lock:
            if active.writers == 0:
                fcntl.flock(active.fd, fcntl.LOCK_SH)
            active.writers += 1

    def release(self, active: ActiveSegment) -> None:
        """A batch reserved in ``active`` is written (or failed); the last one lets GC have the segment."""
        with self._lock:
            active.writers -= 1
            if active.writers or active.fd < 0:
                return
            if active.retired:
                os.close(active.fd)
                active.fd = -1
            else:
                fcntl.flock(active.fd, fcntl.LOCK_UN)

    def gc(self) -> None:
        """Re-measure, expire by age, free down to the watermark if over."""
        freed = Freed()
        with self._dirlock.held():
            segments = list_segments(self.entries)
            if self.options.max_age_s is not None:
                segments = expire(segments, time.time() - self.options.max_age_s, freed)
            usage = sum(segment.size for segment in segments)
            if usage > self.bound:
                usage = free_down_to(segments, usage, int(self.bound * self.options.gc_low_watermark), freed)
            self.usage = usage
        self._record_freed(freed)
        self.counts["gc_runs"] += 1

    def _record_freed(self, freed: Freed) -> None:
        self.index.forget(freed.segments)
        self.counts["gc_removed_segments"] += len(freed.segments)
        self.counts["gc_removed_bytes"] += freed.bytes
        self.counts["gc_expired"] += freed.expired
