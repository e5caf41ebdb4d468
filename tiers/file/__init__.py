"""The file tier: blocks on a local disk or a mounted distributed file system.

Layout: append-only segment files ``<path>/<writer>.<seq>.seg`` (one writer
per tier instance: host, pid and a random id), each a sequence of records (a
48-byte record header with key, version, length and its own checksum, then the
``tiercache.blocks.codec`` value, padded so that every payload lies 64-byte
aligned in the file, as block slots lie in memory: ``records``). Small blocks are
cheap: a batch is one reservation, one ``pwritev`` of its bodies and its record
headers, not a file and a rename per block; a read is one ``preadv`` per
L2-sized run of neighbouring records from a cached descriptor, each payload
checked while still in cache. Every process
keeps an index of key -> (segment, offset, length) from its own writes and from
scanning the new tails of other writers' segments (on a miss and at every GC
pass), so processes and hosts sharing the directory see each other's commits.
A torn or unfinished write is a miss, never wrong KV (``records``); a value that
fails validation on read is a miss, and, when the reader can prove it damaged
(the ``RemoteTier`` contract), tombstoned in the background (deleted for every
reader) and counted (``invalid_deleted``). ``delete`` appends tombstones. All
file I/O runs in a thread pool, never on the event loop.

Capacity (``capacity``): ``max_bytes`` and/or ``max_blocks`` (one is required;
``max_blocks`` is counted as that many full-size records' bytes). A batch
reserves its bytes under a directory-wide ``flock`` before writing, measuring
every writer's segments, so processes sharing the directory together stay under
the bound; when over, GC removes whole segments, least recently used first (by
mtime; reads touch it unless ``touch_on_read: false``), down to
``gc_low_watermark``; a batch that still does not fit fails (``put_full``). On
a disk smaller than the bound, the reservation (``posix_fallocate``) fails with
ENOSPC before anything is written, and GC frees a watermark's worth below what
the directory holds (``gc_nospace``) before one retry. ``max_age_s`` expires
segments not used for that long; ``gc_interval_s`` is the period of the
background pass. ``segment_bytes`` (default 64 MiB, and at most a sixteenth of
the bound): a writer starts a new segment past this size. A segment is locked
against GC only while a batch is being written into it, so however many writers
share the directory, GC can always free what is not in flight.

Only segments are touched (``entries``): a regular file named
``<writer>.<seq>.seg`` that starts like one. Anything else in the directory (a
directory, a FIFO, a symlink, a file the tier may not open, an odd name or
content) is skipped by reads, capacity and GC alike, never opened in a way that
can block, counted (``skipped_entries``) and logged once.
"""

from __future__ import annotations

from tiercache.tiers.file.options import FileOptions
from tiercache.tiers.file.tier import FileTier

__all__ = ["FileOptions", "FileTier"]
