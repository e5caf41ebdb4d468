"""The self-describing value format of remote tiers: a fixed header, then the payload.

A reader validates every header field and the checksum before a byte reaches a
tier's memory, so a value that is truncated, overwritten, from another layout or
namespace, or stored under the wrong key becomes a miss, never wrong KV. Nothing
is ever unpickled: the format is plain bytes.

Header (little-endian, 72 bytes): magic ``TCKV``, format version, flags (bit 0:
lz4), reserved, namespace fingerprint (16 bytes), block key (16 bytes), version
(u64), stored payload length (u64), raw payload length (u64), xxh3-64 of the
stored payload (u64).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import lz4.block
import xxhash

MAGIC = b"TCKV"
FORMAT_VERSION = 1
FLAG_LZ4 = 0x01
HEADER = struct.Struct("<4sBBH16s16sQQQQ")
HEADER_SIZE = HEADER.size


class DecodeStatus(enum.Enum):
    OK = "ok"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_FORMAT = "bad_format"
    WRONG_NAMESPACE = "wrong_namespace"
    WRONG_KEY = "wrong_key"
    BAD_LENGTH = "bad_length"
    BAD_CHECKSUM = "bad_checksum"
    BAD_COMPRESSION = "bad_compression"


@dataclass(frozen=True)
class Header:
    flags: int
    fingerprint: bytes
    key: bytes
    version: int
    stored_length: int
    raw_length: int
    checksum: int


@dataclass(frozen=True)
class Decoded:
    """Outcome of decoding one value: ``status`` OK means ``dest`` holds the payload."""

    status: DecodeStatus
    version: int = 0

    @property
    def ok(self) -> bool:
        return self.status is DecodeStatus.OK


class Codec:
    """Encodes and validates values for one namespace (fingerprint) and block size."""

    def __init__(self, fingerprint: bytes, *, compress: bool = False) -> None:
        if len(fingerprint) != 16:
            raise ValueError("fingerprint must be 16 bytes")
        self.fingerprint = fingerprint
        self.compress = compress

    def encode(self, key: bytes, payload: memoryview | bytes, version: int = 0) -> tuple[bytes, bytes | memoryview]:
        """Return (header, stored payload): send both back to back as one value."""
        raw = memoryview(payload).cast("B")
        flags = 0
        stored: bytes | memoryview = raw
        if self.compress:
            compressed = lz4.block.compress(raw, store_size=False)
            if len(compressed) < len(raw):
                stored, flags = compressed, FLAG_LZ4
        header = HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            0,
            self.fingerprint,
            key,
            version,
            len(stored),
            len(raw),
            xxhash.xxh3_64_intdigest(stored),
        )
        return header, stored

    def encode_value(self, key: bytes, payload: memoryview | bytes, version: int = 0) -> bytes:
        """One contiguous value (header + payload)."""
        header, stored = self.encode(key, payload, version)
        return header + bytes(stored)

    def parse_header(self, key: bytes, value: memoryview | bytes) -> Header | DecodeStatus:
        """Validate everything the header alone can tell."""
        if len(value) < HEADER_SIZE:
            return DecodeStatus.TRUNCATED
        magic, fmt, flags, _, fingerprint, stored_key, version, stored_len, raw_len, checksum = HEADER.unpack_from(
            value
        )
        if magic != MAGIC:
            return DecodeStatus.BAD_MAGIC
        if fmt != FORMAT_VERSION or flags & ~FLAG_LZ4:
            return DecodeStatus.BAD_FORMAT
        if fingerprint != self.fingerprint:
            return DecodeStatus.WRONG_NAMESPACE
        if stored_key != key:
            return DecodeStatus.WRONG_KEY
        if len(value) - HEADER_SIZE < stored_len:
            return DecodeStatus.TRUNCATED
        if len(value) - HEADER_SIZE != stored_len:
            return DecodeStatus.BAD_LENGTH
        return Header(flags, fingerprint, stored_key, version, stored_len, raw_len, checksum)

    def decode_into(self, key: bytes, value: memoryview | bytes, dest: memoryview) -> Decoded:
        """Validate ``value`` and copy its payload into ``dest`` (exactly its size)."""
        header = self.parse_header(key, value)
        if isinstance(header, DecodeStatus):
            return Decoded(header)
        dest = memoryview(dest).cast("B")
        if header.raw_length != len(dest):
            return Decoded(DecodeStatus.BAD_LENGTH)
        stored = memoryview(value)[HEADER_SIZE:]
        if xxhash.xxh3_64_intdigest(stored) != header.checksum:
            return Decoded(DecodeStatus.BAD_CHECKSUM)
        if header.flags & FLAG_LZ4:
            try:
                raw = lz4.block.decompress(stored, uncompressed_size=header.raw_length)
            except lz4.block.LZ4BlockError:
                return Decoded(DecodeStatus.BAD_COMPRESSION)
            if len(raw) != len(dest):
                return Decoded(DecodeStatus.BAD_COMPRESSION)
            dest[:] = raw
        else:
            dest[:] = stored
        return Decoded(DecodeStatus.OK, header.version)
