"""The record format of segment files, and the scan that rebuilds an index from them.

A segment is a sequence of records, each a 48-byte record header followed by
its body. The header (little-endian): magic ``TCSG``, kind (value or
tombstone), 3 reserved bytes, the block key (16 bytes), a version (u64,
nanoseconds since the epoch at write time: the newest record of a key wins), the
body length (u64), and an xxh3-64 of those 40 bytes. A value's body is a
``tiercache.blocks.codec`` value (its own header, key and payload checksum); a
tombstone has no body.

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

RECORD_MAGIC = b"TCSG"
RECORD = struct.Struct("<4sB3x16sQQ")
RECORD_CHECK = struct.Struct("<Q")
RECORD_HEADER_SIZE = RECORD.size + RECORD_CHECK.size


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
    """Offset of the body (just after the record header)."""
    length: int


def pack_header(kind: RecordKind, key: bytes, version: int, length: int) -> bytes:
    """The 48-byte record header for a body of ``length`` bytes."""
    head = RECORD.pack(RECORD_MAGIC, kind, key, version, length)
    return head + RECORD_CHECK.pack(xxhash.xxh3_64_intdigest(head))


def parse_header(data: memoryview | bytes) -> tuple[RecordKind, bytes, int, int] | None:
    """``(kind, key, version, length)``, or None if this is not an intact record header."""
    if len(data) < RECORD_HEADER_SIZE:
        return None
    head = bytes(data[: RECORD.size])
    (check,) = RECORD_CHECK.unpack_from(data, RECORD.size)
    if head[: len(RECORD_MAGIC)] != RECORD_MAGIC or xxhash.xxh3_64_intdigest(head) != check:
        return None
    _magic, kind, key, version, length = RECORD.unpack(head)
    try:
        return RecordKind(kind), key, version, length
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
        kind, key, version, length = parsed
        if length > max_body or offset + RECORD_HEADER_SIZE + length > end:
            break
        records.append(Record(kind, key, version, offset + RECORD_HEADER_SIZE, length))
        offset += RECORD_HEADER_SIZE + length
    return records, offset


def starts_like_a_segment(fd: int) -> bool:
    """Whether a file begins with a record header's magic, or with the zeros of a reservation not yet written."""
    head = os.pread(fd, len(RECORD_MAGIC), 0)
    return head in (RECORD_MAGIC, bytes(len(head)))
