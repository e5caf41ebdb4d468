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

import hashlib
import hmac

import lz4.block
import xxhash

from tiercache.blocks.value_format import (
    CHECKSUM,
    CHECKSUM_OFFSET,
    FINGERPRINT_BYTES,
    FINGERPRINT_OFFSET,
    FLAG_CODED,
    FLAG_LZ4,
    FLAG_MAC,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    KEY_ID_BYTES,
    KEY_OFFSET,
    KEYED_FORMAT_VERSION,
    KNOWN_FLAGS,
    LENGTHS,
    LENGTHS_OFFSET,
    MAC_BYTES,
    MAGIC,
    MAX_SECRET_BYTES,
    MIN_SECRET_BYTES,
    VALUE_KEY_ID_PERSON,
    VERSION_OFFSET,
    CodedPayload,
    Decoded,
    DecodeStatus,
    Header,
    ValueCoding,
)


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
