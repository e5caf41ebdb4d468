"""KVLayout sizes and validation; the value codec rejects every kind of bad value."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import torch
import xxhash

from tiercache.blocks.codec import Codec
from tiercache.blocks.layout import DTYPES, KVLayout, MemoryOrder
from tiercache.blocks.value_format import (
    CHECKSUM_OFFSET,
    FINGERPRINT_OFFSET,
    FLAG_MAC,
    HEADER,
    HEADER_SIZE,
    KEY_ID_BYTES,
    MAGIC,
    VERSION_OFFSET,
    DecodeStatus,
    payload_checksum,
)

FINGERPRINT = bytes(range(16))
KEY = b"k" * 16


def test_layout_sizes_and_shapes() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
    assert layout.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2
    assert layout.layer_piece_bytes == 64 * 1024
    assert layout.pool_shapes(10) == [(10, 2, 32, 16, 8, 128)]
    layer_major = KVLayout(32, 8, 128, "bfloat16", 16, MemoryOrder.LAYER_MAJOR)
    assert layer_major.pool_shapes(10) == [(10, 2, 16, 8, 128)] * 32
    assert layer_major.block_shape == (32, 2, 16, 8, 128)
    assert layout.page_format().fingerprint() != layer_major.page_format().fingerprint()
    assert layout.page_format().fingerprint() == KVLayout(32, 8, 128, "bfloat16", 16).page_format().fingerprint()


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_layout_rejects_non_positive(field: str) -> None:
    values = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    values[field] = 0
    with pytest.raises(ValueError, match=field):
        KVLayout(**values)


def test_validate_pool_rejects_wrong_tensors() -> None:
    layout = KVLayout(2, 2, 8, "float16", 4, MemoryOrder.LAYER_MAJOR)
    good = layout.allocate_pool(6, "cpu")
    assert layout.validate_pool(good) == 6
    with pytest.raises(ValueError, match="expected 2 tensor"):
        layout.validate_pool(good[:1])
    with pytest.raises(ValueError, match="dtype"):
        layout.validate_pool([t.float() for t in good])
    with pytest.raises(ValueError, match="shape"):
        layout.validate_pool([good[0], torch.zeros(6, 2, 4, 2, 9, dtype=torch.float16)])
    with pytest.raises(ValueError, match="contiguous"):
        layout.validate_pool([good[0], good[1].transpose(3, 4).contiguous().transpose(3, 4)])


@pytest.mark.parametrize("compress", [False, True])
def test_codec_roundtrip(compress: bool) -> None:
    codec = Codec(FINGERPRINT, compress=compress)
    payload = bytes(4096) + os.urandom(4096)
    value = codec.encode_value(KEY, payload, version=7)
    if compress:
        assert len(value) < HEADER_SIZE + len(payload)
    dest = bytearray(len(payload))
    decoded = codec.decode_into(KEY, value, memoryview(dest))
    assert decoded.ok and decoded.version == 7
    assert bytes(dest) == payload


def corrupt(value: bytes, offset: int) -> bytes:
    data = bytearray(value)
    data[offset] ^= 0xFF
    return bytes(data)


@pytest.mark.parametrize("compress", [False, True])
def test_codec_rejects_bad_values(compress: bool) -> None:
    codec = Codec(FINGERPRINT, compress=compress)
    payload = bytes(2048) + os.urandom(2048)
    value = codec.encode_value(KEY, payload)
    dest = memoryview(bytearray(len(payload)))
    cases = {
        DecodeStatus.TRUNCATED: [value[:10], value[:-1]],
        DecodeStatus.BAD_MAGIC: [corrupt(value, 0), os.urandom(len(value))],
        DecodeStatus.BAD_FORMAT: [corrupt(value, 4)],
        DecodeStatus.WRONG_NAMESPACE: [Codec(bytes(16), compress=compress).encode_value(KEY, payload)],
        DecodeStatus.WRONG_KEY: [codec.encode_value(b"x" * 16, payload)],
        DecodeStatus.BAD_LENGTH: [value + b"!", codec.encode_value(KEY, payload[:-8])],
        DecodeStatus.BAD_CHECKSUM: [corrupt(value, HEADER_SIZE + 5), corrupt(value, len(value) - 1)],
    }
    for status, values in cases.items():
        for bad in values:
            assert codec.decode_into(KEY, bad, dest).status is status


def test_codec_rejects_a_corrupt_lz4_stream_with_a_valid_checksum() -> None:
    codec = Codec(FINGERPRINT, compress=True)
    payload = bytes(8192)
    _, stored = codec.encode(KEY, payload)
    garbage = b"\xff" * len(stored)
    forged_header, _ = Codec(FINGERPRINT, compress=False).encode(KEY, garbage)
    forged = bytearray(forged_header + garbage)
    forged[5] = 1
    struct.pack_into("<Q", forged, HEADER_SIZE - 16, len(payload))
    assert codec.decode_into(KEY, bytes(forged), memoryview(bytearray(len(payload)))).status is (
        DecodeStatus.BAD_COMPRESSION
    )


SECRET = b"per-namespace-secret-0123456789"


def test_keyed_codec_round_trips_and_survives_a_version_patch() -> None:
    codec = Codec(FINGERPRINT, secret=SECRET)
    payload = os.urandom(4096)
    value = bytearray(codec.encode_value(KEY, payload, version=3))
    assert len(value) == HEADER_SIZE + len(payload)
    dest = memoryview(bytearray(len(payload)))
    assert codec.decode_into(KEY, bytes(value), dest).ok and bytes(dest) == payload
    struct.pack_into("<Q", value, VERSION_OFFSET, 9)  # what the regional tier's commit does on the server
    decoded = codec.decode_into(KEY, bytes(value), dest)
    assert decoded.ok and decoded.version == 9
    assert Codec(FINGERPRINT, secret=SECRET, compress=True).decode_into(KEY, bytes(value), dest).ok


@pytest.mark.parametrize("compress", [False, True])
def test_keyed_codec_rejects_values_without_a_valid_mac(compress: bool) -> None:
    """Every value without this reader's valid MAC is refused; only those it can prove damaged are ``damaged``."""
    codec = Codec(FINGERPRINT, compress=compress, secret=SECRET)
    payload = bytes(2048) + os.urandom(2048)
    value = codec.encode_value(KEY, payload)
    dest = memoryview(bytearray(len(payload)))
    cases = [
        (Codec(FINGERPRINT, compress=compress).encode_value(KEY, payload), DecodeStatus.UNKEYED),  # no secret
        (Codec(FINGERPRINT, compress=compress, secret=OTHER_SECRET).encode_value(KEY, payload), DecodeStatus.OTHER_KEY),
        (Codec(bytes(16), compress=compress, secret=SECRET).encode_value(KEY, payload), DecodeStatus.OTHER_KEY),
        (corrupt(value, HEADER_SIZE + 5), DecodeStatus.BAD_MAC),  # the payload under this reader's own key id
        (corrupt(value, FINGERPRINT_OFFSET + KEY_ID_BYTES), DecodeStatus.BAD_MAC),  # the MAC itself
        (corrupt(value, CHECKSUM_OFFSET), DecodeStatus.BAD_MAC),
        (corrupt(value, FINGERPRINT_OFFSET), DecodeStatus.OTHER_KEY),  # the key id: no longer this reader's
    ]
    for bad, status in cases:
        assert codec.decode_into(KEY, bad, dest).status is status
        assert status.damaged is (status is DecodeStatus.BAD_MAC)
    assert Codec(FINGERPRINT).decode_into(KEY, value, dest).status is DecodeStatus.OTHER_KEY
    assert codec.check_in_place(KEY, bytearray(cases[0][0][:HEADER_SIZE]), memoryview(bytearray(payload))) is (
        DecodeStatus.UNKEYED
    )
    if not compress:
        header, stored = value[:HEADER_SIZE], memoryview(bytearray(value[HEADER_SIZE:]))
        assert codec.check_in_place(KEY, memoryview(bytearray(header)), stored) is DecodeStatus.OK
        flipped = memoryview(bytearray(corrupt(value, -1)))[HEADER_SIZE:]
        assert codec.check_in_place(KEY, bytearray(header), flipped) is DecodeStatus.BAD_MAC


OTHER_SECRET = b"a guessed secret, 32 bytes long!"


def legacy_keyed_value(secret: bytes, key: bytes, payload: bytes, version: int = 0) -> bytes:
    """A keyed value as releases before key ids wrote it (format 1, the slot all MAC), built independently."""
    header = bytearray(HEADER.pack(MAGIC, 1, FLAG_MAC, 0, FINGERPRINT, key, 0, len(payload), len(payload), 0))
    struct.pack_into("<Q", header, CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(payload))
    mac = hashlib.blake2b(bytes(header), key=secret, digest_size=16)
    mac.update(payload)
    header[FINGERPRINT_OFFSET : FINGERPRINT_OFFSET + 16] = mac.digest()
    struct.pack_into("<Q", header, VERSION_OFFSET, version)
    return bytes(header) + payload


def test_keyed_values_of_the_format_before_key_ids_are_left_alone_by_every_reader() -> None:
    """Format-1 keyed values (before key ids: stored under keys and a MAC key no keyed namespace uses any more)
    cannot be judged: never served, never judged damaged, whatever the reader's secret."""
    payload = os.urandom(4096)
    old = legacy_keyed_value(SECRET, KEY, payload, version=5)
    dest = memoryview(bytearray(len(payload)))
    for reader in (Codec(FINGERPRINT, secret=SECRET), Codec(FINGERPRINT, secret=OTHER_SECRET), Codec(FINGERPRINT)):
        for value in (old, corrupt(old, HEADER_SIZE)):
            status = reader.decode_into(KEY, value, dest).status
            assert status is DecodeStatus.BAD_FORMAT and not status.damaged


def test_the_key_id_names_secret_and_namespace_together() -> None:
    ids = {
        Codec(FINGERPRINT, secret=SECRET).key_id,
        Codec(FINGERPRINT, secret=OTHER_SECRET).key_id,
        Codec(bytes(16), secret=SECRET).key_id,
    }
    assert len(ids) == 3 and all(len(key_id) == KEY_ID_BYTES for key_id in ids)
    assert Codec(FINGERPRINT, secret=SECRET, compress=True).key_id == Codec(FINGERPRINT, secret=SECRET).key_id
    assert Codec(FINGERPRINT).key_id == b""


def test_only_damage_a_reader_can_prove_is_damaged() -> None:
    unjudged = {DecodeStatus.OK, DecodeStatus.BAD_FORMAT, DecodeStatus.WRONG_NAMESPACE}
    unjudged |= {DecodeStatus.OTHER_KEY, DecodeStatus.UNKEYED, DecodeStatus.LOSSY}
    assert {status for status in DecodeStatus if not status.damaged} == unjudged


def test_layout_item_sizes_are_torch_s() -> None:
    for dtype in DTYPES:
        layout = KVLayout(1, 1, 1, dtype)
        assert layout.itemsize == torch.empty((), dtype=layout.torch_dtype).element_size()


def test_secret_length_is_checked() -> None:
    with pytest.raises(ValueError, match="secret"):
        Codec(FINGERPRINT, secret=b"short")
    assert Codec(FINGERPRINT, secret=SECRET).variant(compress=True).secret == SECRET


@pytest.mark.parametrize("secret", [None, b"s" * 32])
def test_a_carried_checksum_gives_the_value_a_writer_hashing_itself_gives(secret: bytes | None) -> None:
    codec = Codec(FINGERPRINT, secret=secret)
    payload = os.urandom(8192)
    carried = payload_checksum(payload)
    assert carried == xxhash.xxh3_64_intdigest(payload)
    assert codec.encode_value(KEY, payload, 3, carried) == codec.encode_value(KEY, payload, 3)
    wrong = codec.encode_value(KEY, payload, 3, carried ^ 1)
    if secret:  # a keyed writer hashes every byte for the MAC anyway: it takes no checksum on trust
        assert wrong == codec.encode_value(KEY, payload, 3)
    else:
        status = codec.decode_into(KEY, wrong, memoryview(bytearray(len(payload)))).status
        assert status is DecodeStatus.BAD_CHECKSUM and status.damaged


def test_a_compressed_value_ignores_a_carried_checksum_of_the_raw_bytes() -> None:
    codec = Codec(FINGERPRINT, compress=True)
    payload = bytes(8192)
    value = codec.encode_value(KEY, payload, 0, payload_checksum(payload) ^ 1)
    assert len(value) < HEADER_SIZE + len(payload)
    dest = bytearray(len(payload))
    assert codec.decode_into(KEY, value, memoryview(dest)).ok and bytes(dest) == payload
