"""Append-only segment files with an in-memory index: the storage engine of the file tier.

Each writer (one per tier instance: host, process id and a random id) appends
whole batches to its own segment file ``<writer>.<seq>.seg`` and starts a new
one past ``segment_bytes`` or a sixteenth of the bound (``writer.SEGMENTS_PER_BOUND``),
so GC always has segments to free. A batch is one reservation under the
directory lock (``writer``), one ``pwritev`` of its bodies, then its record
headers (so a header never names a body that is not yet there). Readers keep an index
``key -> (segment, offset, length, version)``: their own writes go straight in,
and other writers' records are found by scanning the new tails of their
segments (on a miss, and at every GC pass), so a reader in another process or
host finds what a writer committed. See ``records`` for why a torn write is a
miss and never wrong KV. Everything here blocks: the tier calls it from worker
threads.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import HEADER_SIZE, DecodeStatus
from tiercache.tiers.file.entries import DirectoryEntries
from tiercache.tiers.file.index import Entry, SegmentIndex
from tiercache.tiers.file.options import FileOptions
from tiercache.tiers.file.records import ALIGNED, Record, RecordKind, pack_header
from tiercache.tiers.file.vectored import IOV_MAX, pwrite_all
from tiercache.tiers.file.writer import SegmentWriter

RUN_BLOCKS = IOV_MAX // 3
"""Most back-to-back records one read ``preadv`` covers (three buffers each)."""
HOT_RUN_BYTES = 1 << 20
"""Payload bytes one read ``preadv`` lands before they are checked: about a core's L2, so that the
checksum reads bytes still in cache (a 32 MiB run checked after its read meets them cold)."""
MAX_RUN_GAP = ALIGNED.alignment + ALIGNED.body_offset
"""Most bytes between two values read in one run (padding, the next record header, a tombstone)."""


class ReadResult(enum.Enum):
    """A read's outcome other than a failed validation (that is the codec's ``DecodeStatus``)."""

    HIT = "hit"
    MISS = "miss"
    IO_ERROR = "io_error"


class SegmentStore:
    """One writer's view of a tier directory: reservations, appends, index, reads, GC."""

    def __init__(
        self,
        root: Path,
        options: FileOptions,
        codec: Codec,
        block_bytes: int,
        counts: Counter,
        note_error: Callable[[str], None],
    ) -> None:
        self.root = root
        self.note_error = note_error
        """Told each I/O failure in words (the tier's ``last_error``)."""
        self.found_invalid: deque[tuple[tuple[bytes, int], DecodeStatus]] = deque()
        """Values reads found invalid, as ((key, version), status), until the tier takes them."""
        self.options = options
        self.codec = codec
        self.max_body = HEADER_SIZE + block_bytes
        self.record_bytes = ALIGNED.span(self.max_body)
        self.bound = options.bound_bytes(self.record_bytes)
        self.counts = counts
        self.entries = DirectoryEntries(root, counts)
        self.index = SegmentIndex(self.entries, self.max_body, counts)
        self.writer = SegmentWriter(self.entries, self.index, options, self.bound, counts, note_error)
        self._local = threading.local()

    # -- lifecycle ---------------------------------------------------------

    def close(self) -> None:
        """Close every descriptor (a shared lock goes with it)."""
        self.index.close()
        self.writer.close()

    @property
    def blocks(self) -> int:
        """Keys this process knows to be stored."""
        return len(self.index)

    def contains(self, key: bytes) -> bool:
        """Whether the index holds ``key`` (call ``refresh`` first to see other writers' latest)."""
        return key in self.index

    # -- reads -------------------------------------------------------------

    def _scratch(self) -> tuple[memoryview, memoryview]:
        """This thread's staging buffer (one whole value) and header buffers (one per block of a run)."""
        local = self._local
        if getattr(local, "staging", None) is None:
            local.staging = memoryview(bytearray(self.max_body))
            local.headers = memoryview(bytearray((HEADER_SIZE + MAX_RUN_GAP) * RUN_BLOCKS))
        return local.staging, local.headers

    def read_batch(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[ReadResult | DecodeStatus]:
        """Read and validate each key into its destination; touch the segments read (LRU).

        Uncompressed values that lie back to back in one segment (a batch written
        together) are read with one ``preadv`` per run, straight into their
        destinations; anything else is read one by one through a staging buffer.
        """
        results: list[ReadResult | DecodeStatus] = [ReadResult.MISS] * len(keys)
        views = [memoryview(dest).cast("B") for dest in dests]
        planned = []
        for index, key in enumerate(keys):
            entry = self.index.get(key)
            if entry is not None:
                planned.append((entry, index))
        planned.sort(key=lambda item: (item[0].segment, item[0].offset))
        run: list[tuple[Entry, int]] = []
        for entry, index in planned:
            if entry.length != HEADER_SIZE + len(views[index]):
                results[index] = self._read_one(keys[index], entry, views[index])
                continue
            if run and not (
                len(run) < RUN_BLOCKS
                and (len(run) + 1) * len(views[index]) <= HOT_RUN_BYTES
                and entry.segment == run[-1][0].segment
                and 0 < entry.offset - run[-1][0].offset - run[-1][0].length <= MAX_RUN_GAP
            ):
                self._read_run(run, keys, views, results)
                run = []
            run.append((entry, index))
        if run:
            self._read_run(run, keys, views, results)
        if self.options.touch_on_read:
            hit_segments = {entry.segment for entry, index in planned if results[index] is ReadResult.HIT}
            for name in hit_segments:
                with contextlib.suppress(OSError):
                    os.utime(self.root / name)
        return results

    def _read_run(
        self, run: list[tuple[Entry, int]], keys: Sequence[bytes], views: list[memoryview], results: list
    ) -> None:
        """One ``preadv`` of nearby uncompressed records into their destinations (what lies between them into
        scratch), then validate each."""
        fd = self.index.fd(run[0][0].segment)
        if fd is None:
            return
        _, headers = self._scratch()
        buffers: list[memoryview] = []
        slots = []
        for position, (entry, index) in enumerate(run):
            at = position * (HEADER_SIZE + MAX_RUN_GAP)
            if position:
                previous = run[position - 1][0]
                gap = entry.offset - previous.offset - previous.length
                buffers.append(headers[at - gap : at])  # padding and the next record's header: skipped
            slots.append(headers[at : at + HEADER_SIZE])
            buffers += [slots[-1], views[index]]
        expected = sum(len(buffer) for buffer in buffers)
        try:
            count = os.preadv(fd, buffers, run[0][0].offset)
        except OSError:
            count = -1
        for (entry, index), header in zip(run, slots, strict=True):
            if count != expected:
                results[index] = self._read_one(keys[index], entry, views[index])
                continue
            status = self.codec.check_in_place(keys[index], header, views[index])
            results[index] = ReadResult.HIT if status is DecodeStatus.OK else self._invalid(keys[index], entry, status)

    def _read_one(self, key: bytes, entry: Entry, dest: memoryview) -> ReadResult | DecodeStatus:
        """Read one value through the staging buffer and decode it into ``dest``."""
        fd = self.index.fd(entry.segment)
        if fd is None:
            return ReadResult.MISS
        staging = self._scratch()[0][: entry.length]
        try:
            count = os.preadv(fd, [staging], entry.offset)
        except OSError:
            return ReadResult.IO_ERROR
        if count != entry.length:
            return self._invalid(key, entry, DecodeStatus.TRUNCATED)
        status = self.codec.decode_into(key, staging, dest).status
        return ReadResult.HIT if status is DecodeStatus.OK else self._invalid(key, entry, status)

    def _invalid(self, key: bytes, entry: Entry, status: DecodeStatus) -> DecodeStatus:
        """A value that failed validation: noted in ``found_invalid`` (the tier judges, and removes the damaged)."""
        self.found_invalid.append(((key, entry.version), status))
        return status

    # -- writes ------------------------------------------------------------

    def put_batch(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], checksums: Sequence[int | None]
    ) -> list[bool]:
        """Encode (with the checksums the writer carried), reserve the batch's bytes (GC first if needed),
        append, index; True per stored key."""
        version = time.time_ns()
        encoded = [
            self.codec.encode(key, payload, version, checksum)
            for key, payload, checksum in zip(keys, payloads, checksums, strict=True)
        ]
        lengths = [len(header) + len(stored) for header, stored in encoded]
        spans = [ALIGNED.span(length) for length in lengths]
        total = sum(spans)
        reserved = self.writer.reserve(total, len(keys))
        if reserved is None:
            return [False] * len(keys)
        active, start = reserved
        placeholder = bytes(ALIGNED.body_offset)  # the record header (written last) and the padding after it
        buffers: list[memoryview | bytes] = []
        for (header, stored), length in zip(encoded, lengths, strict=True):
            buffers += [placeholder, header, memoryview(stored).cast("B")]
            tail = ALIGNED.tail(length)
            if tail:
                buffers.append(bytes(tail))
        try:
            pwrite_all(active.fd, buffers, start)
            headers = []
            offset = start
            for key, length, span in zip(keys, lengths, spans, strict=True):
                headers.append((pack_header(RecordKind.VALUE, key, version, length), offset))
                offset += span
            for header, at in headers:
                pwrite_all(active.fd, [header], at)
            if self.options.fsync:
                os.fdatasync(active.fd)
        except OSError as error:
            self.counts["put_io_error"] += len(keys)
            self.note_error(f"put: {error}")
            self.writer.retire(active)
            return [False] * len(keys)
        finally:
            self.writer.release(active)
        self.index.apply_all(
            active.name,
            (
                Record(RecordKind.VALUE, key, version, at + ALIGNED.body_offset, length)
                for (_header, at), key, length in zip(headers, keys, lengths, strict=True)
            ),
        )
        self.counts["put_ok"] += len(keys)
        self.counts["bytes_written"] += total
        return [True] * len(keys)

    def delete(self, keys: Sequence[bytes], version: int | None = None) -> int:
        """Tombstone ``keys`` (up to ``version``, default now); best effort; return how many were indexed."""
        version = time.time_ns() if version is None else version
        known = self.index.tombstone(keys, version)
        reserved = self.writer.reserve(ALIGNED.span(0) * len(keys), 0)
        if reserved is None:
            self.counts["delete_unlogged"] += len(keys)
            return known
        active, start = reserved
        try:
            pwrite_all(active.fd, [ALIGNED.record(RecordKind.TOMBSTONE, key, version) for key in keys], start)
        except OSError:
            self.counts["delete_unlogged"] += len(keys)
            self.writer.retire(active)
        finally:
            self.writer.release(active)
        return known

    # -- GC ----------------------------------------------------------------

    def gc(self) -> None:
        """Re-measure, expire by age, free down to the watermark if over; then refresh the index."""
        self.writer.gc()
        self.index.refresh()
