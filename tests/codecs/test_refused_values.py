"""A damaged lossy value is refused by ``KVCoding.decode_into`` itself, never decoded: real K/V (SmolLM2 on ShareGPT)
of a layout and of an engine's pages, at int8 and compact, with every field flipped, the value truncated and
extended; with its integrity word (any damage) and with the word recomputed after the damage (what the decoders'
own checks catch). An intact value decodes as before, and nothing the encoder writes is refused."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from support.coded_tiers import view
from support.lossy_pages import int8_page_bound

from tiercache.blocks.layout import KVLayout, MemoryOrder, PageLayout
from tiercache.blocks.token_map import interleaved_map
from tiercache.codecs import levels
from tiercache.codecs.coding import INTEGRITY_BYTES, KVCoding, integrity_word
from tiercache.codecs.compact import WORD
from tiercache.codecs.geometry import KVGeometry
from tiercache.codecs.int8 import (
    INT8_MAX,
    INT8_MIN,
    SCALE_BYTES,
    SMALLEST_SCALE,
    encode_int8,
)
from tiercache.codecs.levels import Level, level_key
from tiercache.codecs.tables import DIGEST_BYTES, CompactTables

SMALLEST_NORMAL_SCALE = 2.0**-14
"""float16's smallest normal: the scale a test damages is one from it up (a real group's, not an all-zero one's)."""

HEAD = 64
"""SmolLM2's head size."""
BLOCK = 32
"""Tokens per block (two compact chunks)."""
SENTINEL = 7
"""What a slot holds before a refused decode (each byte), and must still hold after it."""
FLIPS_PER_FIELD = 16
"""Bits flipped in each field, spread over it."""
SPREAD_FLIPS = 384
"""Bits flipped over the whole value, evenly apart (the stride odd, so every bit of a byte comes up)."""
SEED = 55
"""Seeds the random bytes of an extension."""
FLOAT16_NAN, FLOAT16_INF, FLOAT16_SIGN = 0x7E00, 0x7C00, 0x8000
"""float16 bit patterns: a NaN, +inf, the sign bit."""
EXPONENT_BIT = 12
"""A float16 exponent bit: flipped, a scale is 16 times off (still finite: real KV's scales are far below 2**11)."""
WORD_FLIPS = 64
"""Bits flipped in compact's entropy-coded words, each with its integrity word recomputed."""
MAGNITUDES = 4096
"""Groups of random values, their magnitudes log-spaced from 1e-12 up to ``LARGEST``."""
LARGEST = {"float32": 6.0, "float16": 4.0, "bfloat16": 6.0}
"""The largest magnitude's power of ten per dtype (float16 holds no more than 65504)."""
ZERO_EVERY = 97
"""Every n-th group is all zero, the next one all zero but its first value."""
SMALLEST_NORMAL_BITS = 0x0400
"""float16's smallest normal, as bits."""
LARGEST_EDGE_BITS = {"float32": 0x7BFF, "float16": 0x5BFF, "bfloat16": 0x7BFF}
"""Below which float16 scale (bits) a rounding edge is tried: its group's largest value must fit the dtype."""
EDGE_STRIDE = 7
"""Every n-th float16 scale's rounding edge is tried."""
SUBNORMAL_CLIP = INT8_MAX * SMALLEST_SCALE / 2
"""How far past ``absmax / 254`` a group under a subnormal float16 scale may decode (``tiercache.codecs.int8``):
its scale may round half a step of float16's grid below absmax / 127, and its largest values clip at 127 of it."""
PAST_FLOAT16 = 1e9
"""A float32 value whose scale would be past float16's largest."""
KINDS = ("layout", "pages")
BITS_PER_BYTE = 8


def flash_slot(sample: torch.Tensor) -> torch.Tensor:
    """A block of ``sample`` as FlashAttention's pages, a layer each: ``[layers, heads, tokens, 2 * head]``."""
    part = sample[:, :, :BLOCK].unflatten(-1, (-1, HEAD))  # [layers, 2, tokens, heads, head]
    return torch.cat([part[:, 0].transpose(1, 2), part[:, 1].transpose(1, 2)], dim=-1).half().contiguous()


def layout_block(sample: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A block of ``sample`` in a block-major ``layout``: ``[2, layers, tokens, heads, head]``."""
    part = sample[:, :, :BLOCK].unflatten(-1, (-1, HEAD))
    return part.transpose(0, 1).to(layout.torch_dtype).contiguous()


def coding_and_block(kind: str, sample: torch.Tensor, tables: CompactTables) -> tuple[KVCoding, torch.Tensor]:
    """A float16 block of ``sample`` and the int8 and compact coding of its geometry (a layout's or pages')."""
    layers, _, _, channels = sample.shape
    if kind == "layout":
        layout = KVLayout(layers, channels // HEAD, HEAD, "float16", BLOCK, MemoryOrder.BLOCK_MAJOR)
        return KVCoding(KVGeometry.of(layout), [Level.INT8, Level.COMPACT], tables), layout_block(sample, layout)
    slot = flash_slot(sample)
    pages = PageLayout(slot.numel() * slot.element_size(), BLOCK, None, "float16", HEAD,
                       interleaved_map(layers, 1, channels // HEAD, HEAD, BLOCK, "test"))
    return KVCoding(KVGeometry.of(pages), [Level.INT8, Level.COMPACT], tables), slot


@dataclass(frozen=True)
class Case:
    """One block's stored value at one level, and where its fields lie (byte ranges of the stored value)."""

    coding: KVCoding
    level: Level
    block: torch.Tensor
    stored: bytes
    fields: dict[str, tuple[int, int]]

    @property
    def payload(self) -> bytes:
        """The level's payload, after the integrity word."""
        return self.stored[INTEGRITY_BYTES:]

    @property
    def untouched(self) -> bytes:
        """A slot's bytes before a decode (a refused one must leave them)."""
        return bytes([SENTINEL]) * self.coding.geometry.block_bytes

    def refused(self, stored: bytes) -> bool:
        """Whether ``decode_into`` refuses ``stored`` and leaves the slot as it was."""
        slot = bytearray(self.untouched)
        decoded = self.coding.decode_into(self.level.coding, memoryview(stored), memoryview(slot))
        return not decoded and slot == self.untouched

    def why(self, payload: bytes) -> str | None:
        """Why the level's decoder refuses ``payload`` stored with its integrity word recomputed (None: decoded)."""
        slot = bytearray(self.untouched)
        stored = integrity_word(self.level.coding, payload) + payload
        why = self.coding.refusal(self.level.coding, memoryview(stored), memoryview(slot))
        assert why is None or slot == self.untouched, "a refused value wrote into the slot"
        return why

    def decoded(self, stored: bytes) -> torch.Tensor:
        slot = torch.full_like(self.block, SENTINEL)
        assert self.coding.decode_into(self.level.coding, memoryview(stored), view(slot))
        return slot


def field_ranges(coding: KVCoding, level: Level, size: int) -> dict[str, tuple[int, int]]:
    """The byte ranges of a stored value's fields at ``level`` (``size`` bytes in all)."""
    start = INTEGRITY_BYTES
    fields = {"integrity": (0, start)}
    if level is Level.INT8:
        scales = start + coding.geometry.groups * SCALE_BYTES
        return {**fields, "scales": (start, scales), "integers": (scales, size)}
    assert coding.compact is not None
    anchors = coding.compact.head_bytes - DIGEST_BYTES
    count = anchors // (SCALE_BYTES + coding.geometry.channels)
    digest = start + DIGEST_BYTES
    scales, head = digest + SCALE_BYTES * count, start + coding.compact.head_bytes
    return {**fields, "digest": (start, digest), "scales": (digest, scales), "anchors": (scales, head),
            "words": (head, size)}


def make_case(kind: str, level: Level, real_kv: list[torch.Tensor], tables: CompactTables) -> Case:
    coding, block = coding_and_block(kind, real_kv[0], tables)
    stored = coding.encode(level, view(block)).data
    return Case(coding, level, block, stored, field_ranges(coding, level, len(stored)))


@pytest.fixture(scope="module", params=[(kind, level) for kind in KINDS for level in (Level.INT8, Level.COMPACT)],
                ids=lambda param: f"{param[0]}-{param[1].value}")
def case(request: pytest.FixtureRequest, real_kv: list[torch.Tensor], tables: CompactTables) -> Case:
    return make_case(*request.param, real_kv, tables)


@pytest.fixture(scope="module", params=KINDS)
def int8_case(request: pytest.FixtureRequest, real_kv: list[torch.Tensor], tables: CompactTables) -> Case:
    return make_case(request.param, Level.INT8, real_kv, tables)


@pytest.fixture(scope="module", params=KINDS)
def compact_case(request: pytest.FixtureRequest, real_kv: list[torch.Tensor], tables: CompactTables) -> Case:
    return make_case(request.param, Level.COMPACT, real_kv, tables)


def first_normal_scale(case: Case) -> int:
    """The index of the first scale (or anchor scale) that is a normal float16."""
    start, end = case.fields["scales"]
    scales = np.frombuffer(case.stored, np.float16, (end - start) // SCALE_BYTES, offset=start)
    return int(np.flatnonzero(scales >= SMALLEST_NORMAL_SCALE)[0])


def flipped(stored: bytes, bit: int) -> bytes:
    damaged = bytearray(stored)
    damaged[bit // BITS_PER_BYTE] ^= 1 << bit % BITS_PER_BYTE
    return bytes(damaged)


def flip_positions(case: Case) -> list[int]:
    """Bits spread over each field, and over the whole value."""
    bits = []
    for start, end in case.fields.values():
        bits += np.linspace(start * BITS_PER_BYTE, end * BITS_PER_BYTE - 1, FLIPS_PER_FIELD).astype(int).tolist()
    total = len(case.stored) * BITS_PER_BYTE
    return sorted(set(bits + list(range(0, total, total // SPREAD_FLIPS | 1))))


def test_an_intact_value_decodes_as_before_through_its_integrity_word(case: Case) -> None:
    assert case.stored[:INTEGRITY_BYTES] == integrity_word(case.level.coding, case.payload)
    slot = case.decoded(case.stored)
    if case.level is Level.INT8:
        assert case.payload == encode_int8(case.coding.geometry, view(case.block))
        groups = case.coding.geometry.groups
        scales = np.frombuffer(case.payload, np.float16, groups).astype(np.float32)
        integers = np.frombuffer(case.payload, np.int8, offset=SCALE_BYTES * groups).reshape(groups, -1)
        expected = torch.empty_like(case.block)
        case.coding.geometry.write(torch.from_numpy(integers * scales[:, None]), view(expected))
    else:
        assert case.coding.compact is not None
        assert case.payload == case.coding.compact.encode(view(case.block))
        expected = torch.full_like(case.block, SENTINEL)
        assert case.coding.compact.decode_into(memoryview(case.payload), view(expected)) is None
    assert torch.equal(slot.view(torch.int16), expected.view(torch.int16)), "the decoded bits changed"
    assert not torch.equal(slot, case.block), "a lossy level that changed nothing"


def test_every_field_flipped_is_refused(case: Case) -> None:
    positions = flip_positions(case)
    for name, (start, end) in case.fields.items():
        assert any(start * BITS_PER_BYTE <= bit < end * BITS_PER_BYTE for bit in positions), name
    accepted = [bit for bit in positions if not case.refused(flipped(case.stored, bit))]
    assert not accepted, f"{len(accepted)} of {len(positions)} flipped bits decoded, the first at bit {accepted[0]}"


def test_a_truncated_or_extended_value_is_refused(case: Case) -> None:
    stored = case.stored
    head = case.fields["integers" if case.level is Level.INT8 else "words"][0]
    extra = random.Random(SEED).randbytes(4)
    cuts = {"1": stored[:-1], "4": stored[:-4], "8": stored[:-8], "half": stored[: len(stored) // 2],
            "head only": stored[:head], "integrity word only": stored[:INTEGRITY_BYTES], "empty": b""}
    extensions = {"1": stored + extra[:1], "4": stored + extra, "a zero word": stored + bytes(WORD.itemsize)}
    for what, damaged in [*(("cut " + k, v) for k, v in cuts.items()), *(("extended " + k, v)
                                                                       for k, v in extensions.items())]:
        assert case.refused(damaged), what


def test_int8_refuses_scales_and_integers_it_never_writes(int8_case: Case) -> None:
    case = int8_case
    payload = case.payload
    groups = case.coding.geometry.groups
    scales = np.frombuffer(payload, np.uint16, groups)
    integers = np.frombuffer(payload, np.int8, offset=SCALE_BYTES * groups).reshape(groups, -1)
    normal = first_normal_scale(case)

    def with_scale(bits: int) -> bytes:
        changed = scales.copy()
        changed[normal] = bits
        return changed.tobytes() + payload[SCALE_BYTES * groups :]

    def with_integers(row: np.ndarray) -> bytes:
        changed = integers.copy()
        changed[normal] = row
        return payload[: SCALE_BYTES * groups] + changed.tobytes()

    for bits in (int(scales[normal]) | FLOAT16_SIGN, FLOAT16_NAN, FLOAT16_INF, FLOAT16_INF | FLOAT16_SIGN, 0):
        assert "scale" in (case.why(with_scale(bits)) or ""), hex(bits)
    row = integers[normal].copy()
    row[np.argmin(np.abs(row))] = INT8_MIN
    assert str(INT8_MIN) in (case.why(with_integers(row)) or "")
    for damaged in (payload[:-1], payload + b"\0", payload[: SCALE_BYTES * groups]):
        assert "bytes, not this geometry's" in (case.why(damaged) or "")


def test_compact_refuses_anchors_and_streams_it_never_writes(compact_case: Case) -> None:
    case = compact_case
    payload = case.payload
    start = INTEGRITY_BYTES
    scales_at, anchors_at, words_at = (case.fields[name][0] - start for name in ("scales", "anchors", "words"))
    count = (anchors_at - scales_at) // SCALE_BYTES
    scales = np.frombuffer(payload, np.uint16, count, offset=scales_at)
    anchors = np.frombuffer(payload, np.int8, words_at - anchors_at, offset=anchors_at).reshape(count, -1)
    normal = first_normal_scale(case)

    def with_scale(bits: int) -> bytes:
        changed = scales.copy()
        changed[normal] = bits
        return payload[:scales_at] + changed.tobytes() + payload[anchors_at:]

    def with_anchor(row: np.ndarray) -> bytes:
        changed = anchors.copy()
        changed[normal] = row
        return payload[:anchors_at] + changed.tobytes() + payload[words_at:]

    for bits in (int(scales[normal]) | FLOAT16_SIGN, FLOAT16_NAN, FLOAT16_INF, 0):
        assert "scale" in (case.why(with_scale(bits)) or ""), hex(bits)
    row = anchors[normal].copy()
    row[np.argmin(np.abs(row))] = INT8_MIN
    assert str(INT8_MIN) in (case.why(with_anchor(row)) or "")
    assert "digest" in (case.why(flipped(payload, DIGEST_BYTES * BITS_PER_BYTE // 2)) or "")
    extra = random.Random(SEED).randbytes(WORD.itemsize - 1) + b"\1"  # a last word that is not zero
    streams = {"cut a word": payload[:-4], "cut two words": payload[:-8], "extended by a word": payload + extra,
               "extended by a zero word": payload + bytes(WORD.itemsize)}
    words = range(words_at * BITS_PER_BYTE, len(payload) * BITS_PER_BYTE)
    words_bits = words[:: len(words) // WORD_FLIPS | 1]
    streams.update({f"bit {bit} flipped": flipped(payload, bit) for bit in words_bits})
    for what, damaged in streams.items():
        assert "entropy-coded" in (case.why(damaged) or ""), what
    for damaged in (payload[:-1], payload + b"\1", payload[: words_at - 1]):
        assert "whole words" in (case.why(damaged) or "")


def test_what_only_the_integrity_word_refuses(case: Case) -> None:
    """A scale's exponent flipped (a whole group 16 times off) reads as a value the encoder could write, and so do
    compact's words cut to none; the integrity word refuses both."""
    scale_bit = (case.fields["scales"][0] + SCALE_BYTES * first_normal_scale(case)) * BITS_PER_BYTE + EXPONENT_BIT
    damaged = [flipped(case.stored, scale_bit)]
    if case.level is Level.COMPACT:
        damaged.append(case.stored[: case.fields["words"][0]])
    for stored in damaged:
        assert case.why(stored[INTEGRITY_BYTES:]) is None, "the decoder's checks alone refused it"
        assert case.refused(stored)


@pytest.mark.parametrize("dtype", list(LARGEST))
def test_no_group_the_encoder_writes_is_refused(dtype: str) -> None:
    """Groups of every magnitude (all zero, one value, float16-subnormal scales, a largest magnitude whose scale
    lies halfway between two float16s, past float16's range) encode to values the decoder accepts."""
    generator = torch.Generator().manual_seed(SEED)
    spread = torch.randn(MAGNITUDES, HEAD, generator=generator) * torch.logspace(-12, LARGEST[dtype],
                                                                                MAGNITUDES).unsqueeze(1)
    spread[::ZERO_EVERY] = 0
    spread[1::ZERO_EVERY, 1:] = 0
    below = torch.arange(SMALLEST_NORMAL_BITS, LARGEST_EDGE_BITS[dtype], EDGE_STRIDE, dtype=torch.int16)
    edges = torch.zeros(len(below), HEAD)
    edges[:, 0] = (below.view(torch.float16).float() + (below + 1).view(torch.float16).float()) / 2 * INT8_MAX
    values = torch.cat([spread, edges, -edges])
    slot = values.flatten().to(getattr(torch, dtype))
    if dtype == "float32":
        slot[-HEAD:] = PAST_FLOAT16  # past float16's scales: clipped, never inf
    pages = PageLayout(slot.numel() * slot.element_size(), BLOCK, None, dtype, HEAD)
    coding = KVCoding(KVGeometry.of(pages), [Level.INT8])
    stored = coding.encode(Level.INT8, view(slot)).data
    out = torch.full_like(slot, SENTINEL)
    assert coding.refusal(Level.INT8.coding, memoryview(stored), view(out)) is None
    assert torch.isfinite(out.float()).all()
    original = slot.view(-1, HEAD)[:-1]  # the last group clipped when it is float32's
    error = (out.view(-1, HEAD)[:-1].float() - original.float()).abs()
    assert (error <= int8_page_bound(original.float(), HEAD, dtype) + SUBNORMAL_CLIP).all()


def test_lossy_keys_name_the_value_format(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release writing another lossy format stores under other keys: a reader never meets (and deletes) its values."""
    key = bytes(range(16))
    current = {level: level_key(key, level) for level in Level}
    monkeypatch.setattr(levels, "LOSSY_FORMAT", levels.LOSSY_FORMAT - 1)
    assert level_key(key, Level.EXACT) == key == current[Level.EXACT]
    assert all(level_key(key, level) != current[level] for level in Level if level.lossy)
