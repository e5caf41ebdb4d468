"""The file tier's record layouts: payloads 64-byte aligned on disk, and segments written before still read."""

from __future__ import annotations

import os
import time

from support.file_tier_helpers import BLOCK, open_tier, segments_in

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.testing.redis_servers import empty_dests, random_blocks, remote_context
from tiercache.tiers.file.records import ALIGNED, PACKED, PAYLOAD_ALIGNMENT, Record, RecordKind, scan


def records_of(path: os.PathLike) -> tuple[list[Record], int, int]:
    """Every record of a segment, where the scan stopped, and the file's size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        records, stop = scan(fd, 0, size, HEADER_SIZE + BLOCK)
        return records, stop, size
    finally:
        os.close(fd)


def test_layout_spans_and_offsets() -> None:
    # Independent arithmetic: 48-byte record header, 72-byte codec header, 64-byte alignment.
    assert (ALIGNED.body_offset + HEADER_SIZE) % 64 == 0 and ALIGNED.body_offset >= 48
    assert ALIGNED.span(HEADER_SIZE + BLOCK) == 128 + BLOCK
    assert ALIGNED.span(0) == 64 and ALIGNED.span(1) == 64 and ALIGNED.span(9) == 128
    assert PACKED.span(HEADER_SIZE + BLOCK) == 48 + HEADER_SIZE + BLOCK
    record = ALIGNED.record(RecordKind.TOMBSTONE, bytes(16), 7)
    assert len(record) == 64 and record[:4] == b"TCSA"


async def test_written_payloads_and_records_are_64_byte_aligned(tmp_path) -> None:
    tier = await open_tier(tmp_path)
    try:
        keys, payloads = random_blocks(6, BLOCK)
        assert all(await tier.put(keys[:3], payloads[:3]))
        await tier.delete(keys[:1])  # a tombstone between two batches keeps the next records aligned
        assert all(await tier.put(keys[3:], payloads[3:]))
        out = empty_dests(6, BLOCK)
        assert await tier.get_into(keys, out) == [False] + [True] * 5
        assert [bytes(d) for d in out[1:]] == [bytes(p) for p in payloads[1:]]
    finally:
        await tier.close()
    [segment] = segments_in(tmp_path)
    records, stop, size = records_of(segment.path)
    assert [r.kind for r in records] == [RecordKind.VALUE] * 3 + [RecordKind.TOMBSTONE] + [RecordKind.VALUE] * 3
    assert stop == size and size % PAYLOAD_ALIGNMENT == 0
    for record in records:
        assert (record.offset - ALIGNED.body_offset) % PAYLOAD_ALIGNMENT == 0  # the record starts aligned
        if record.kind is RecordKind.VALUE:
            assert (record.offset + HEADER_SIZE) % PAYLOAD_ALIGNMENT == 0  # so does its payload


async def test_a_segment_written_before_payloads_were_aligned_is_still_read(tmp_path) -> None:
    """Packed records (body right after the header, magic TCSG), back to back and after a tombstone, read in one
    batch (the run read skips 48-byte gaps) and one by one; a packed record after aligned ones reads too."""
    keys, payloads = random_blocks(6, BLOCK)
    codec = Codec(remote_context(BLOCK).codec.fingerprint)
    values = [codec.encode_value(key, payload) for key, payload in zip(keys, payloads, strict=True)]
    now = time.time_ns()
    old = [PACKED.record(RecordKind.VALUE, keys[i], now, values[i]) for i in range(4)]
    old.insert(2, PACKED.record(RecordKind.TOMBSTONE, keys[5], now))
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "old-writer.000001.seg").write_bytes(b"".join(old))
    tier = await open_tier(tmp_path)
    try:
        out = empty_dests(4, BLOCK)
        assert await tier.get_into(keys[:4], out) == [True] * 4
        assert [bytes(d) for d in out] == [bytes(p) for p in payloads[:4]]
        single = empty_dests(1, BLOCK)
        assert await tier.get_into(keys[3:4], single) == [True] and bytes(single[0]) == bytes(payloads[3])
        assert all(await tier.put(keys[4:5], payloads[4:5]))
    finally:
        await tier.close()
    [mine] = [s for s in segments_in(tmp_path) if not os.path.basename(s.path).startswith("old-writer")]
    with open(mine.path, "ab") as handle:  # a packed record appended after aligned ones
        handle.write(PACKED.record(RecordKind.VALUE, keys[5], time.time_ns(), values[5]))
    reopened = await open_tier(tmp_path)
    try:
        out = empty_dests(2, BLOCK)
        assert await reopened.get_into(keys[4:6], out) == [True, True]
        assert [bytes(d) for d in out] == [bytes(p) for p in payloads[4:6]]
        assert "get_invalid" not in str(reopened.stats())
    finally:
        await reopened.close()


async def test_compressed_bodies_of_any_length_are_padded_so_the_next_record_starts_aligned(tmp_path) -> None:
    tier = await open_tier(tmp_path, compress=True)
    keys, _ = random_blocks(4, BLOCK)
    payloads = [memoryview(bytes(range(i + 1)) * (BLOCK // (i + 1)) + bytes(BLOCK % (i + 1))) for i in range(4)]
    try:
        assert all(await tier.put(keys, payloads))
        out = empty_dests(4, BLOCK)
        assert await tier.get_into(keys, out) == [True] * 4
        assert [bytes(d) for d in out] == [bytes(p) for p in payloads]
    finally:
        await tier.close()
    [segment] = segments_in(tmp_path)
    records, stop, size = records_of(segment.path)
    assert len(records) == 4 and stop == size
    assert len({record.length for record in records}) > 1 and any(r.length % PAYLOAD_ALIGNMENT for r in records)
    assert all((record.offset - ALIGNED.body_offset) % PAYLOAD_ALIGNMENT == 0 for record in records)
