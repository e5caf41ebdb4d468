"""The record format of segment files, and the scan that rebuilds an index from them.

A segment is a sequence of records, each a 48-byte record header followed by
its body. The header (little-endian): a magic that names the record's layout,
kind (value or tombstone), 3 reserved bytes, the block key (16 bytes), a version
(u64, nanoseconds since the epoch at write time: the newest record of a key
wins), the body length (u64), and an xxh3-64 of those 40 bytes. A value's body
is a ``tiercache.blocks.codec`` value (its own header, key and payload
checksum); a tombstone has no body.

Two layouts (``RecordLayout``). ``ALIGNED`` (magic ``TCSA``, what writers write):
a record starts on a 64-byte boundary and takes a multiple of 64 bytes, its body
placed so that the payload after the codec header is 64-byte aligned in the
file: the kernel then copies page cache to and from block slots (64-byte
aligned, as torch allocates them) at full speed, where a payload 16 or 40 bytes
off made a 2 MiB read about 30% slower on this project's development machine.
``PACKED`` (magic ``TCSG``, written before): the body right after the header;
still read. A reader that knows only ``TCSG`` skips an aligned segment (it does
not start like a segment to it) and never misreads one.

Crash safety: a torn or never-finished write leaves a header that fails its
checksum (or zeros from the writer's reservation), and a scan stops there; a
body torn after a good header fails the codec's checksum on read, which is a
miss. Nothing in a segment is trusted before both checks pass.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass

import xxhash

from tiercache.blocks.value_format import HEADER_SIZE

RECORD = struct.Struct("<4sB3x16sQQ")
RECORD_CHECK = struct.Struct("<Q")
RECORD_HEADER_SIZE = RECORD.size + RECORD_CHECK.size
PAYLOAD_ALIGNMENT = 64
"""Bytes an aligned record's start, size and payload are multiples of (a cache line)."""


def round_up(count: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``count``."""
    return -(-count // multiple) * multiple


@dataclass(frozen=True)
class RecordLayout:
    """Where a record's body lies after its header, and how far the next record starts."""

    magic: bytes
    body_offset: int
    """From the record's start to its body."""
    alignment: int
    """Records start at, and take, multiples of this many bytes."""

    def span(self, length: int) -> int:
        """Bytes a record with a body of ``length`` bytes takes, padding included."""
        return round_up(self.body_offset + length, self.alignment)

    def tail(self, length: int) -> int:
        """Padding bytes after a body of ``length`` bytes, up to where the next record starts."""
        return self.span(length) - self.body_offset - length

    def record(self, kind: RecordKind, key: bytes, version: int, body: bytes = b"") -> bytes:
        """A whole record: header, padding, body, padding."""
        head = pack_header(kind, key, version, len(body), self)
        return head + bytes(self.body_offset - len(head)) + body + bytes(self.tail(len(body)))


PACKED = RecordLayout(b"TCSG", RECORD_HEADER_SIZE, 1)
"""The body right after the header (segments written before payloads were aligned)."""
ALIGNED = RecordLayout(
    b"TCSA", round_up(RECORD_HEADER_SIZE + HEADER_SIZE, PAYLOAD_ALIGNMENT) - HEADER_SIZE, PAYLOAD_ALIGNMENT
)
"""What writers write: the payload after the body's codec header 64-byte aligned in the file."""
LAYOUTS = {layout.magic: layout for layout in (ALIGNED, PACKED)}
MAGIC_BYTES = len(ALIGNED.magic)


class RecordKind(enum.IntEnum):
    """What a record says about its key."""

    VALUE = 1
    """The body is the key's codec value."""
    TOMBSTONE = 2
    """The key was deleted: records of it up to this version are gone."""


@dataclass(frozen=True)
class Record:
    """One record found by a scan: where its body lies in the segment."""

    kind: RecordKind
    key: bytes
    version: int
    offset: int
    """Offset of the body (after the record header and its layout's padding)."""
    length: int


def pack_header(kind: RecordKind, key: bytes, version: int, length: int, layout: RecordLayout = ALIGNED) -> bytes:
    """The 48-byte record header for a body of ``length`` bytes laid out as ``layout``."""
    head = RECORD.pack(layout.magic, kind, key, version, length)
    return head + RECORD_CHECK.pack(xxhash.xxh3_64_intdigest(head))


def parse_header(data: memoryview | bytes) -> tuple[RecordKind, bytes, int, int, RecordLayout] | None:
    """``(kind, key, version, length, layout)``, or None if this is not an intact record header."""
    if len(data) < RECORD_HEADER_SIZE:
        return None
    head = bytes(data[: RECORD.size])
    (check,) = RECORD_CHECK.unpack_from(data, RECORD.size)
    layout = LAYOUTS.get(head[:MAGIC_BYTES])
    if layout is None or xxhash.xxh3_64_intdigest(head) != check:
        return None
    _magic, kind, key, version, length = RECORD.unpack(head)
    try:
        return RecordKind(kind), key, version, length, layout
    except ValueError:
        return None


def scan(fd: int, start: int, end: int, max_body: int) -> tuple[list[Record], int]:
    """Records in ``[start, end)`` of an open segment, and the offset the scan stopped at.

    One small read per record (its header). The scan stops at the first header
    that is not intact, at a body longer than ``max_body``, or at a record that
    runs past ``end`` (still being written, or torn); a later scan resumes from
    the returned offset.
    """
    records: list[Record] = []
    offset = start
    while offset + RECORD_HEADER_SIZE <= end:
        parsed = parse_header(os.pread(fd, RECORD_HEADER_SIZE, offset))
        if parsed is None:
            break
        kind, key, version, length, layout = parsed
        if length > max_body or offset + layout.body_offset + length > end:
            break
        records.append(Record(kind, key, version, offset + layout.body_offset, length))
        offset += layout.span(length)
    return records, offset


def starts_like_a_segment(fd: int) -> bool:
    """Whether a file begins with a record header's magic, or with the zeros of a reservation not yet written."""
    head = os.pread(fd, MAGIC_BYTES, 0)
    return head in LAYOUTS or head == bytes(len(head))
