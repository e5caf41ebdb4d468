"""The self-describing value format of remote tiers: a fixed header, then the payload.

A reader validates every header field and the checksum before a byte reaches a
tier's memory, so a value that is truncated, overwritten, from another layout or
namespace, or stored under the wrong key becomes a miss, never wrong KV. Nothing
is ever unpickled: the format is plain bytes.

Header (little-endian, 72 bytes): magic ``TCKV``, format version, flags (bit 0:
lz4, bit 1: keyed MAC, bit 2: coded), the coding (u16: which lossy encoding and
level the payload is in, 0 for exact KV), namespace fingerprint (16 bytes), block
key (16 bytes), version (u64), stored payload length (u64), raw payload length
(u64), xxh3-64 of the stored payload (u64).

Coded values (``FLAG_CODED``). A value whose payload is a lossy encoding of the
block (``tiercache.codecs``: int8, the compact level) says so in its flags and
names the encoding in the coding field; its raw length is still the block's. A
reader decodes it only when it opted into that coding (``Codec(...,
coding=...)``), straight into the destination; any other reader answers
``LOSSY`` and leaves the value where it is (it is valid, just not this
reader's), and a release that predates coded values sees an unknown flag
(``BAD_FORMAT``) and leaves it too. So a reader that has not opted into lossy KV
never loads lossy KV. The checksum or MAC covers the stored (coded) payload, as
for lz4.

Keyed values (``Codec(..., secret=...)``). The checksum is no signature: anyone
with write access to the store who knows the namespace can forge a value that
checks. With a per-namespace secret the writer sets the MAC flag, writes format
2, and stores in the fingerprint's 16 bytes a key id (4 bytes: a keyed BLAKE2b of
the fingerprint under the secret, so it names secret and namespace together)
and a keyed BLAKE2b-96 MAC over the header (with the real fingerprint in that
slot and the version zeroed: the regional tier patches versions in place on the
server) followed by the stored payload. A reader with the secret accepts only
values whose MAC verifies. Unkeyed values keep format 1 (their bytes are
unchanged, so readers of either release share them); a keyed value of format 1
(written before key ids, its 16 bytes all MAC, under a key and MAC key no keyed
namespace uses any more) is left alone by every reader (``BAD_FORMAT``: it
cannot be judged). The header keeps its size and offsets, so the xxh3 field
still serves the regional tier's server-side compare-and-set.

Judging a value that fails (``DecodeStatus.damaged``). A reader deletes a value
only when it can prove it damaged: bytes that are no tiercache value (too short
for a header, a wrong magic), or a value of its own (its namespace, and its key
id when keyed) that is stored under another key, has inconsistent lengths, or
whose checksum, MAC or compression fails. A value it cannot judge is left where
it is: another namespace (``WRONG_NAMESPACE``), a MAC under a key it does not
hold (``OTHER_KEY``: another secret, or the reader has none), a value without
the MAC this reader requires (``UNKEYED``), an unknown format (``BAD_FORMAT``).
The ownership checks come first, so a reader never judges another's value.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Protocol

import lz4.block
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


class Codec:
    """Encodes and validates values for one namespace (fingerprint) and block size.

    ``secret`` (16-64 bytes, optional): values carry a keyed MAC instead of
    trusting the checksum alone (see the module docstring). A topology's codec
    gets the MAC key ``tiercache.remote.secret`` stretches from the namespace's secret,
    never the secret itself. ``coding`` (optional): the lossy codings this reader
    opted into; without it every coded value reads as ``LOSSY``.
    """

    def __init__(
        self, fingerprint: bytes, *, compress: bool = False, secret: bytes | None = None,
        coding: ValueCoding | None = None,
    ) -> None:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError("fingerprint must be 16 bytes")
        if secret is not None and not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise ValueError(f"secret must be {MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} bytes")
        self.fingerprint = fingerprint
        self.compress = compress
        self.secret = secret
        self.coding = coding
        self._flags = FLAG_MAC if secret is not None else 0
        self._format = FORMAT_VERSION
        self.key_id = b""
        """The key id keyed values carry (empty without a secret)."""
        slot = fingerprint
        if secret is not None:
            self._format = KEYED_FORMAT_VERSION
            self.key_id = hashlib.blake2b(
                fingerprint, key=secret, digest_size=KEY_ID_BYTES, person=VALUE_KEY_ID_PERSON
            ).digest()
            slot = self.key_id + bytes(MAC_BYTES)
        fixed = HEADER.pack(MAGIC, self._format, self._flags, 0, slot, bytes(16), 0, 0, 0, 0)
        self._fixed_prefix = fixed[: FINGERPRINT_OFFSET + KEY_ID_BYTES if secret is not None else KEY_OFFSET]
        """What every valid uncompressed value's header starts with (the MAC differs per value)."""
        self._last_size = -1
        self._last_lengths = b""

    @property
    def keyed(self) -> bool:
        """Whether values carry a keyed MAC."""
        return self.secret is not None

    def variant(self, *, compress: bool) -> Codec:
        """The same namespace, secret and codings with another compression setting (for a tier's own option)."""
        return Codec(self.fingerprint, compress=compress, secret=self.secret, coding=self.coding)

    def reading(self, coding: ValueCoding | None) -> Codec:
        """The same namespace, secret and compression reading the lossy codings of ``coding``."""
        return Codec(self.fingerprint, compress=self.compress, secret=self.secret, coding=coding)

    def _mac(self, header: bytes | bytearray | memoryview, stored: memoryview | bytes) -> bytes:
        """Keyed BLAKE2b over the header (real fingerprint, version zeroed) and the stored payload."""
        canonical = bytearray(header[:HEADER_SIZE])
        canonical[FINGERPRINT_OFFSET:KEY_OFFSET] = self.fingerprint
        canonical[VERSION_OFFSET:LENGTHS_OFFSET] = bytes(8)
        mac = hashlib.blake2b(canonical, key=self.secret or b"", digest_size=MAC_BYTES)
        mac.update(stored)
        return mac.digest()

    def encode(
        self, key: bytes, payload: memoryview | bytes | CodedPayload, version: int = 0, checksum: int | None = None
    ) -> tuple[bytes, bytes | memoryview]:
        """Return (header, stored payload): send both back to back as one value.

        ``payload``: the block's bytes, or a ``CodedPayload`` (a lossy encoding of
        them, stored as it is with ``FLAG_CODED``).

        ``checksum``: ``payload_checksum(payload)`` where the caller already has it
        (computed when the block was written, while its bytes were hot), so that
        encoding touches no payload byte; a wrong one makes every read of the value
        fail its check (a miss, never wrong KV). Unused when the payload is compressed
        or keyed (the MAC reads every byte anyway, and the field must match it).
        """
        flags = self._flags
        coding = 0
        stored: bytes | memoryview
        if isinstance(payload, CodedPayload):
            stored, raw_length, coding, checksum = payload.data, payload.raw_length, payload.coding, None
            flags |= FLAG_CODED
        else:
            raw = payload
            if not isinstance(raw, memoryview) or raw.format != "B" or raw.ndim != 1:
                raw = memoryview(payload).cast("B")
            stored, raw_length = raw, len(raw)
            if self.compress:
                compressed = lz4.block.compress(raw, store_size=False)
                if len(compressed) < len(raw):
                    stored, flags, checksum = compressed, flags | FLAG_LZ4, None
        if self.secret is not None:
            checksum = None
        header = HEADER.pack(
            MAGIC,
            self._format,
            flags,
            coding,
            self.fingerprint,
            key,
            version,
            len(stored),
            raw_length,
            xxhash.xxh3_64_intdigest(stored) if checksum is None else checksum,
        )
        if self.secret is not None:
            header = header[:FINGERPRINT_OFFSET] + self.key_id + self._mac(header, stored) + header[KEY_OFFSET:]
        return header, stored

    def encode_value(
        self, key: bytes, payload: memoryview | bytes | CodedPayload, version: int = 0, checksum: int | None = None
    ) -> bytes:
        """One contiguous value (header + payload); ``checksum`` as in ``encode``."""
        header, stored = self.encode(key, payload, version, checksum)
        return header + bytes(stored)

    def parse_header(self, key: bytes, value: memoryview | bytes) -> Header | DecodeStatus:
        """Validate everything the header alone can tell (``value``: the whole value)."""
        if len(value) < HEADER_SIZE:
            return DecodeStatus.TRUNCATED
        return self.check_header(key, value, len(value))

    def check_header(
        self, key: bytes, header: memoryview | bytes | bytearray, value_length: int
    ) -> Header | DecodeStatus:
        """Validate a header (at least ``HEADER_SIZE`` bytes) of a value of ``value_length`` bytes.

        Whose the value is comes first (see the module docstring): a value this
        reader cannot judge is reported as such before any field of it is.
        """
        magic, fmt, flags, coding, fingerprint, stored_key, version, stored_len, raw_len, checksum = (
            HEADER.unpack_from(header)
        )
        if magic != MAGIC:
            return DecodeStatus.BAD_MAGIC
        keyed = bool(flags & FLAG_MAC)
        if flags & ~KNOWN_FLAGS or fmt != (KEYED_FORMAT_VERSION if keyed else FORMAT_VERSION):
            return DecodeStatus.BAD_FORMAT
        if keyed:
            if self.secret is None or fingerprint[:KEY_ID_BYTES] != self.key_id:
                return DecodeStatus.OTHER_KEY
        elif fingerprint != self.fingerprint:
            return DecodeStatus.WRONG_NAMESPACE
        elif self.secret is not None:
            return DecodeStatus.UNKEYED
        if bool(flags & FLAG_CODED) != bool(coding) or (coding and flags & FLAG_LZ4):
            return DecodeStatus.BAD_FORMAT
        if coding and (self.coding is None or not self.coding.reads(coding)):
            return DecodeStatus.LOSSY
        if stored_key != key:
            return DecodeStatus.WRONG_KEY
        if value_length - HEADER_SIZE < stored_len:
            return DecodeStatus.TRUNCATED
        if value_length - HEADER_SIZE != stored_len:
            return DecodeStatus.BAD_LENGTH
        return Header(flags, coding, fingerprint, stored_key, version, stored_len, raw_len, checksum)

    def verify(self, header: memoryview | bytes | bytearray, stored: memoryview | bytes, expected: int) -> DecodeStatus:
        """Check the stored payload against a validated header: the MAC if keyed, else the checksum."""
        if self.secret is None:
            return DecodeStatus.OK if xxhash.xxh3_64_intdigest(stored) == expected else DecodeStatus.BAD_CHECKSUM
        mac = self._mac(header, stored)
        found = header[FINGERPRINT_OFFSET + KEY_ID_BYTES : KEY_OFFSET]
        return DecodeStatus.OK if hmac.compare_digest(mac, found) else DecodeStatus.BAD_MAC

    def check_in_place(self, key: bytes, header: bytes | bytearray | memoryview, payload: memoryview) -> DecodeStatus:
        """Validate an uncompressed value whose payload was received straight into ``payload``.

        The fast path of a reader that received ``header`` and the payload in one
        call: the fixed fields are compared in place with precomputed bytes (no
        parsing, no copies); only a mismatch takes the field-by-field parse, for
        the exact status to count.
        """
        if isinstance(header, memoryview):
            header = header.tobytes()
        size = len(payload)
        if size != self._last_size:
            self._last_size, self._last_lengths = size, LENGTHS.pack(size, size)
        if (
            header.startswith(self._fixed_prefix)
            and header.startswith(key, KEY_OFFSET)
            and header.startswith(self._last_lengths, LENGTHS_OFFSET)
        ):
            if self.secret is None:
                if xxhash.xxh3_64_intdigest(payload) == CHECKSUM.unpack_from(header, CHECKSUM_OFFSET)[0]:
                    return DecodeStatus.OK
                return DecodeStatus.BAD_CHECKSUM
            return self.verify(header, payload, 0)
        parsed = self.check_header(key, header, HEADER_SIZE + size)
        if isinstance(parsed, DecodeStatus):
            return parsed
        if parsed.flags & FLAG_LZ4 or parsed.raw_length != size:
            return DecodeStatus.BAD_LENGTH
        status = self.verify(header, payload, parsed.checksum)
        if status is DecodeStatus.OK and parsed.coding:  # a coded value exactly a block long: decode from a copy
            return self._decode_coded(parsed.coding, memoryview(payload.tobytes()), payload)
        return status

    def decode_into(self, key: bytes, value: memoryview | bytes, dest: memoryview) -> Decoded:
        """Validate ``value`` and copy its payload into ``dest`` (exactly its size)."""
        header = self.parse_header(key, value)
        if isinstance(header, DecodeStatus):
            return Decoded(header)
        dest = memoryview(dest).cast("B")
        if header.raw_length != len(dest):
            return Decoded(DecodeStatus.BAD_LENGTH)
        stored = memoryview(value)[HEADER_SIZE:]
        status = self.verify(value, stored, header.checksum)
        if status is not DecodeStatus.OK:
            return Decoded(status)
        if header.coding:
            status = self._decode_coded(header.coding, stored, dest)
            return Decoded(status, header.version if status is DecodeStatus.OK else 0)
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

    def _decode_coded(self, coding: int, stored: memoryview, dest: memoryview) -> DecodeStatus:
        """Decode a checked coded payload into ``dest`` (``check_header`` made sure this reader reads it)."""
        assert self.coding is not None
        try:
            decoded = self.coding.decode_into(coding, stored, dest)
        except (ValueError, RuntimeError, IndexError):
            decoded = False
        return DecodeStatus.OK if decoded else DecodeStatus.BAD_CODING
