"""The ``options`` of a ``type: file`` tier, validated when the topology is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tiercache.common.fields import (
    FieldError,
    fraction,
    int_in_range,
    non_empty_string,
    number_in_range,
    parse_size,
    positive_timeout_s,
    worker_count,
)

MAX_FILE_TIER_BYTES = 1 << 60
"""Largest ``max_bytes`` (and ``max_blocks``) accepted: an exabyte; more is a unit mistake."""
MAX_AGE_S = 10 * 365 * 24 * 3600.0
"""Longest ``max_age_s``: ten years."""
DEFAULT_SEGMENT_BYTES = 64 << 20
"""Default size at which a writer starts a new segment file."""
MIN_SEGMENT_BYTES = 1 << 16
"""Smallest ``segment_bytes``: smaller segments only multiply files (a batch never splits anyway)."""
MAX_SEGMENT_BYTES = 1 << 36
"""Largest ``segment_bytes`` (64 GiB): GC frees whole segments, so they must stay small next to the bound."""
DEFAULT_THREADS = 4
"""Parallel file operations by default, fewer where fewer cores are usable: a read the page cache
answers is a copy that needs a core (on 2 cores, two threads read 2 MiB blocks 3-32% faster than
four); a file system whose reads wait (NFS) gains from more than the cores: set ``threads``."""


def default_threads() -> int:
    """``DEFAULT_THREADS``, or the cores this process may run on if fewer."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(DEFAULT_THREADS, usable or 1))


@dataclass(frozen=True)
class FileOptions:
    """The ``options`` of a ``type: file`` tier.

    ``path``: the root directory (created if missing; may be shared by processes
    and hosts). ``max_bytes`` (``"20GiB"`` or an integer) and/or ``max_blocks``:
    capacity, one required; ``max_blocks`` counts full-size records (a bound of
    ``max_blocks`` uncompressed blocks' bytes). ``max_age_s``: expire segments
    unused for that long. ``gc_interval_s``: period of the background pass
    (re-measure, expire, pick up other writers' segments). ``gc_low_watermark``:
    a capacity GC frees down to this fraction. ``touch_on_read``: reads refresh
    their segment's mtime (GC frees the least recently used segments first).
    ``fsync``: make each batch durable before it is acknowledged. ``compress``:
    lz4. ``threads``: parallel file operations (default ``default_threads``). ``segment_bytes``: a writer
    starts a new segment file past this size (or past a sixteenth of the bound,
    if that is smaller).
    """

    path: str
    max_bytes: int | str | None = None
    max_blocks: int | None = None
    max_age_s: float | None = None
    gc_interval_s: float = 30.0
    gc_low_watermark: float = 0.9
    touch_on_read: bool = True
    fsync: bool = False
    compress: bool = False
    threads: int = field(default_factory=default_threads)
    segment_bytes: int | str = DEFAULT_SEGMENT_BYTES

    def __post_init__(self) -> None:
        non_empty_string("path", self.path)
        if self.max_bytes is None and self.max_blocks is None:
            raise FieldError("max_bytes", "max_bytes and/or max_blocks: a file tier must be bounded")
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", _size("max_bytes", self.max_bytes, 1, MAX_FILE_TIER_BYTES))
        if self.max_blocks is not None:
            int_in_range("max_blocks", self.max_blocks, 1, MAX_FILE_TIER_BYTES)
        if self.max_age_s is not None:
            number_in_range("max_age_s", self.max_age_s, 0.0, MAX_AGE_S, low_open=True)
        positive_timeout_s("gc_interval_s", self.gc_interval_s)
        fraction("gc_low_watermark", self.gc_low_watermark, low_open=True)
        worker_count("threads", self.threads)
        segment = _size("segment_bytes", self.segment_bytes, MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES)
        object.__setattr__(self, "segment_bytes", segment)

    def bound_bytes(self, record_bytes: int) -> int:
        """The directory's byte bound: ``max_bytes``, and ``max_blocks`` full-size records."""
        bounds = [self.max_bytes] if self.max_bytes is not None else []
        if self.max_blocks is not None:
            bounds.append(self.max_blocks * record_bytes)
        return min(bounds)


def _size(field: str, value: int | str, low: int, high: int) -> int:
    try:
        size = parse_size(value)
    except (ValueError, OverflowError):
        raise FieldError(field, "a size such as 20GiB or an integer", value) from None
    return int_in_range(field, size, low, high)
