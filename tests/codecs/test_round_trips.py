"""Every level round-trips real KV within its stated bound (a bound, never equality), for every engine dtype,
both memory orders, a TP rank's share of the heads and a hybrid model's layer groups; what does not decode is
refused, never written as garbage."""

from __future__ import annotations

import pytest
import torch
from support.lossy_pages import compact_bound

from tiercache.blocks.codec import Codec
from tiercache.blocks.layout import KVLayout, MemoryOrder, PageLayout
from tiercache.blocks.value_format import CodedPayload, DecodeStatus
from tiercache.codecs.coding import KVCoding
from tiercache.codecs.geometry import KVGeometry, UnsupportedPages
from tiercache.codecs.int8 import INT8_MAX
from tiercache.codecs.levels import Level
from tiercache.codecs.tables import CHUNK_TOKENS, CompactTables, learn_tables

HEAD_DIM = 64
DTYPE_RELATIVE_ERROR = {"float32": 2**-23, "float16": 2**-10, "bfloat16": 2**-7, "float8_e4m3fn": 2**-3}
"""Half an ulp of each engine dtype, relative: the decoded value is rounded to it once more."""
TINY = 1e-6


def block_of(sample: torch.Tensor, layout: KVLayout, start: int = 0) -> torch.Tensor:
    """One block of ``sample`` (``[layers, 2, tokens, channels]``) in ``layout``'s dtype and memory order."""
    part = sample[:, :, start : start + layout.block_size]
    shaped = part.reshape(layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if layout.memory is MemoryOrder.BLOCK_MAJOR:
        shaped = shaped.transpose(0, 1)
    return shaped.to(layout.torch_dtype).contiguous()


def as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def values(layout: KVLayout, block: torch.Tensor) -> torch.Tensor:
    return KVGeometry.of(layout).values(as_bytes(block))


def round_trip(coding: KVCoding, level: Level, layout: KVLayout, block: torch.Tensor) -> torch.Tensor:
    payload = coding.encode(level, as_bytes(block))
    out = torch.empty_like(block)
    assert coding.decode_into(payload.coding, memoryview(payload.data), as_bytes(out))
    return values(layout, out)


def float16_coding(sample: torch.Tensor, tables: CompactTables) -> tuple[KVLayout, KVCoding]:
    """A float16 block-major layout of ``sample``'s shape and its int8 and compact coding."""
    layers, _, _, channels = sample.shape
    layout = KVLayout(layers, channels // HEAD_DIM, HEAD_DIM, "float16", CHUNK_TOKENS)
    return layout, KVCoding(KVGeometry.of(layout), [Level.INT8, Level.COMPACT], tables)


def int8_bound(original: torch.Tensor, dtype: str) -> torch.Tensor:
    """Half a step of each token's scale, plus the engine dtype's rounding of the result."""
    scale = original.abs().amax(-1, keepdim=True) / INT8_MAX
    return scale / 2 * (1 + 2**-10) + original.abs() * DTYPE_RELATIVE_ERROR[dtype] * 2 + TINY


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("memory", list(MemoryOrder))
def test_each_level_round_trips_real_kv_within_its_bound(
    real_kv: list[torch.Tensor], tables: CompactTables, dtype: str, memory: MemoryOrder
) -> None:
    layers, _, tokens, channels = real_kv[0].shape
    layout = KVLayout(layers, channels // HEAD_DIM, HEAD_DIM, dtype, CHUNK_TOKENS * 2, memory)
    coding = KVCoding(KVGeometry.of(layout), [Level.INT8, Level.COMPACT], tables)
    for sample in real_kv:
        for start in range(0, tokens, layout.block_size):
            block = block_of(sample, layout, start)
            original = values(layout, block)
            for level, bound in ((Level.INT8, int8_bound(original, dtype)),
                                 (Level.COMPACT, compact_bound(original, tables, dtype))):
                error = (round_trip(coding, level, layout, block) - original).abs()
                assert (error <= bound).all(), (level, dtype, float((error - bound).max()))
                assert error.max() > 0 or dtype.startswith("float8"), "a lossy level that changed nothing"


def test_int8_scales_each_head_apart(real_kv: list[torch.Tensor], tables: CompactTables) -> None:
    """A head of small values beside a head of large ones keeps its own step: within its own absmax / 254."""
    sample = real_kv[0].clone()
    layout = KVLayout(sample.shape[0], sample.shape[-1] // HEAD_DIM, HEAD_DIM, "float32", CHUNK_TOKENS)
    sample[:, :, :, :HEAD_DIM] /= 16  # the first head's values a sixteenth of the others' (float16 scales stay normal)
    block = block_of(sample, layout)
    original = values(layout, block)
    decoded = round_trip(KVCoding(KVGeometry.of(layout), [Level.INT8]), Level.INT8, layout, block)
    small = original[..., :HEAD_DIM]
    error = (decoded[..., :HEAD_DIM] - small).abs()
    assert (error <= int8_bound(small, "float32")).all(), float(error.max())


def test_a_compact_delta_past_the_learned_range_is_coded_not_clipped(
    real_kv: list[torch.Tensor], tables: CompactTables
) -> None:
    """A K delta 1.5x the range the tables learned (rare in real KV, and the largest error when clipped) decodes
    within half a step of where it was, as any delta inside the alphabet does."""
    sample = real_kv[0].clone()
    layout = KVLayout(sample.shape[0], sample.shape[-1] // HEAD_DIM, HEAD_DIM, "float32", CHUNK_TOKENS,
                      MemoryOrder.LAYER_MAJOR)
    coding = KVCoding(KVGeometry.of(layout), [Level.COMPACT], tables)
    layer, token, channel = sample.shape[0] // 2, CHUNK_TOKENS // 2, 5
    step = float(tables.steps[layer, 0, channel])
    learned_range = step * (1 << int(tables.bits[layer, 0])) / 2
    sample[layer, 0, token, channel] = sample[layer, 0, 0, channel] + 1.5 * learned_range
    block = block_of(sample, layout)
    original = values(layout, block)
    decoded = round_trip(coding, Level.COMPACT, layout, block)
    anchor_error = float(original[layer, 0, 0].abs().max()) / INT8_MAX / 2 * (1 + 2**-10)
    error = float((decoded - original)[layer, 0, token, channel].abs())
    assert error <= step / 2 + anchor_error + TINY, (error, step, learned_range)


def test_compact_is_smaller_than_int8_and_int8_than_the_engine_dtype(
    real_kv: list[torch.Tensor], tables: CompactTables
) -> None:
    layout, coding = float16_coding(real_kv[0], tables)
    block = as_bytes(block_of(real_kv[0], layout))
    sizes = {level: len(coding.encode(level, block).data) for level in (Level.INT8, Level.COMPACT)}
    assert sizes[Level.COMPACT] < sizes[Level.INT8] < len(block) / 1.9


@pytest.mark.parametrize("rank", range(3))
def test_a_tp_ranks_share_of_the_heads_round_trips_with_tables_of_its_own(
    learned_kv: list[torch.Tensor], real_kv: list[torch.Tensor], rank: int
) -> None:
    share = slice(rank * HEAD_DIM, (rank + 1) * HEAD_DIM)
    tables = learn_tables(sample[..., share] for sample in learned_kv)
    layers = real_kv[0].shape[0]
    layout = KVLayout(layers, 1, HEAD_DIM, "bfloat16", CHUNK_TOKENS, MemoryOrder.LAYER_MAJOR)
    coding = KVCoding(KVGeometry.of(layout), [Level.COMPACT], tables)
    block = block_of(real_kv[1][..., share], layout)
    original = values(layout, block)
    error = (round_trip(coding, Level.COMPACT, layout, block) - original).abs()
    assert (error <= compact_bound(original, tables, "bfloat16")).all()


def test_a_hybrid_models_groups_of_layers_each_round_trip(learned_kv: list[torch.Tensor],
                                                          real_kv: list[torch.Tensor]) -> None:
    channels = real_kv[0].shape[-1]
    for group in (slice(0, None, 2), slice(1, None, 2)):  # two KV-cache groups, as a sliding + full model keeps
        tables = learn_tables(sample[group] for sample in learned_kv)
        sample = real_kv[0][group]
        layout = KVLayout(sample.shape[0], channels // HEAD_DIM, HEAD_DIM, "float16", CHUNK_TOKENS)
        coding = KVCoding(KVGeometry.of(layout), [Level.INT8, Level.COMPACT], tables)
        block = block_of(sample, layout)
        original = values(layout, block)
        error = (round_trip(coding, Level.COMPACT, layout, block) - original).abs()
        assert (error <= compact_bound(original, tables, "float16")).all()


def test_opaque_pages_and_integer_kv_are_refused() -> None:
    with pytest.raises(UnsupportedPages):
        KVGeometry.of(PageLayout(4096, 16))
    with pytest.raises(UnsupportedPages):
        KVGeometry.of(KVLayout(2, 1, 8, "uint8", 16))


def test_a_coded_value_that_does_not_decode_is_a_damaged_miss_and_leaves_the_slot_alone(
    real_kv: list[torch.Tensor], tables: CompactTables
) -> None:
    layout, coding = float16_coding(real_kv[0], tables)
    codec = Codec(bytes(16), coding=coding)
    block = block_of(real_kv[0], layout)
    key = b"k" * 16
    for level in (Level.INT8, Level.COMPACT):
        good = coding.encode(level, as_bytes(block))
        cut = CodedPayload(good.coding, good.data[: len(good.data) // 2], good.raw_length)  # checksummed, cut
        slot = torch.full_like(block, 7)
        decoded = codec.decode_into(key, codec.encode_value(key, cut), as_bytes(slot))
        assert decoded.status is DecodeStatus.BAD_CODING and decoded.status.damaged
        assert (slot == 7).all(), "a value that does not decode wrote into the slot"
        flipped = bytearray(codec.encode_value(key, good))
        flipped[-3] ^= 0x40
        decoded = codec.decode_into(key, bytes(flipped), as_bytes(slot))
        assert decoded.status is DecodeStatus.BAD_CHECKSUM and (slot == 7).all()
