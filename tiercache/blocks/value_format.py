"""A stored value's format: the fixed header every remote value starts with, and what a reader makes of a value.

Header (little-endian, 72 bytes): magic ``TCKV``, format version, flags (bit 0:
lz4, bit 1: keyed MAC, bit 2: coded), the coding (u16: which lossy encoding and
level the payload is in, 0 for exact KV), namespace fingerprint (16 bytes), block
key (16 bytes), version (u64), stored payload length (u64), raw payload length
(u64), xxh3-64 of the stored payload (u64). ``codec`` writes and checks it (the
keyed MAC, lz4, coded values); ``DecodeStatus`` says what a reader found, and
which of its answers prove a value damaged (``docs/architecture.md``, "Failure,
bad input and security": a reader deletes only what it can prove damaged).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Protocol

import xxhash

MAGIC = b"TCKV"
FORMAT_VERSION = 1
"""Unkeyed values (and keyed values written before key ids, see the module docstring)."""
KEYED_FORMAT_VERSION = 2
"""Keyed values whose MAC slot starts with the key id."""
FLAG_LZ4 = 0x01
FLAG_MAC = 0x02
"""The fingerprint slot holds a keyed MAC (see the module docstring)."""
FLAG_CODED = 0x04
"""The payload is a lossy encoding named by the header's coding field (see the module docstring)."""
KNOWN_FLAGS = FLAG_LZ4 | FLAG_MAC | FLAG_CODED
HEADER = struct.Struct("<4sBBH16s16sQQQQ")
HEADER_SIZE = HEADER.size
FINGERPRINT_BYTES = 16
FORMAT_OFFSET = 4
"""Byte offset of the format version."""
FINGERPRINT_OFFSET = 8
"""Where the fingerprint (or, in keyed values, the MAC) lies in the header."""
KEY_OFFSET = FINGERPRINT_OFFSET + FINGERPRINT_BYTES
VERSION_OFFSET = KEY_OFFSET + 16
"""Byte offset of the u64 version."""
LENGTHS_OFFSET = VERSION_OFFSET + 8
"""Byte offset of the stored and raw payload lengths (two u64)."""
CHECKSUM_OFFSET = LENGTHS_OFFSET + 16
"""Byte offset of the u64 xxh3-64 of the stored payload."""
LENGTHS = struct.Struct("<QQ")
CHECKSUM = struct.Struct("<Q")
KEY_ID_BYTES = 4
"""Bytes of the key id at the start of a keyed value's MAC slot (two secrets share one with odds 2**-32)."""
MAC_BYTES = FINGERPRINT_BYTES - KEY_ID_BYTES
"""BLAKE2b digest size of the keyed MAC (96 bits), after the key id in the slot."""
VALUE_KEY_ID_PERSON = b"tiercache-keyid"
"""BLAKE2b personalisation of the key id, so it is never a MAC of anything else."""
MIN_SECRET_BYTES = 16
"""A shorter secret is refused."""
MAX_SECRET_BYTES = 64
"""BLAKE2b's longest key."""


def payload_checksum(payload: memoryview | bytes) -> int:
    """The checksum a value's header carries for an uncompressed ``payload`` (xxh3-64 of its bytes): what a
    writer computes once, where the block's bytes are hot, and hands to every ``encode`` of that block."""
    return xxhash.xxh3_64_intdigest(payload)


class DecodeStatus(enum.Enum):
    """Why a value was (not) accepted; the non-OK values are counted by name in tiers' stats."""

    OK = "ok"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_FORMAT = "bad_format"
    WRONG_NAMESPACE = "wrong_namespace"
    WRONG_KEY = "wrong_key"
    BAD_LENGTH = "bad_length"
    BAD_CHECKSUM = "bad_checksum"
    BAD_COMPRESSION = "bad_compression"
    BAD_MAC = "bad_mac"
    OTHER_KEY = "other_key"
    """A MAC under a key this reader does not hold (another secret or namespace, or the reader has no secret)."""
    UNKEYED = "unkeyed"
    """A value without a MAC, read by a reader that requires one."""
    LOSSY = "lossy"
    """A coded (lossy) value this reader did not opt into, or whose coding it does not know: left in place."""
    BAD_CODING = "bad_coding"
    """A coded value of a coding this reader reads, whose payload passed its check but does not decode."""

    @property
    def damaged(self) -> bool:
        """Whether the reader can prove the value damaged, so that deleting it destroys nothing valid."""
        return self not in UNJUDGED


UNJUDGED = frozenset(
    {
        DecodeStatus.OK,
        DecodeStatus.BAD_FORMAT,
        DecodeStatus.WRONG_NAMESPACE,
        DecodeStatus.OTHER_KEY,
        DecodeStatus.UNKEYED,
        DecodeStatus.LOSSY,
    }
)
"""Outcomes that prove nothing wrong with the value: it is valid, or not this reader's to judge."""


@dataclass(frozen=True)
class Header:
    """The fields of a parsed header (``fingerprint`` is the MAC in keyed values)."""

    flags: int
    coding: int
    """The lossy coding of a coded value (``FLAG_CODED``), 0 for exact KV."""
    fingerprint: bytes
    key: bytes
    version: int
    stored_length: int
    raw_length: int
    checksum: int


class ValueCoding(Protocol):
    """What a reader that opted into lossy KV decodes coded values with (``tiercache.codecs`` implements it)."""

    def reads(self, coding: int) -> bool:
        """Whether this reader opted into values of ``coding`` (and knows how to decode them)."""
        ...

    def decode_into(self, coding: int, stored: memoryview, dest: memoryview) -> bool:
        """Decode a checked payload straight into ``dest`` (the block's bytes); False when it does not decode."""
        ...


@dataclass(frozen=True)
class CodedPayload:
    """A block already encoded by a lossy coding, handed to ``Codec.encode`` in place of its raw bytes."""

    coding: int
    """Which coding and level (never 0: that is exact KV)."""
    data: bytes
    """The coded payload."""
    raw_length: int
    """The block's bytes (what a reader decodes it into)."""


@dataclass(frozen=True)
class Decoded:
    """Outcome of decoding one value: ``status`` OK means ``dest`` holds the payload."""

    status: DecodeStatus
    version: int = 0

    @property
    def ok(self) -> bool:
        return self.status is DecodeStatus.OK
