"""PagedKV: K/V written through a block table land in the right pool blocks, in both orders and every dtype."""

from __future__ import annotations

import pytest
import torch

from tiercache import PagedKV, blocks_needed
from tiercache.blocks.layout import DTYPES, KVLayout

LAYERS, HEADS, DIM, BLOCK = 3, 2, 4, 4
POOL_BLOCKS = 8
TABLE = [5, 2, 7, 0]
"""A scrambled block table: logical block i lives in pool block TABLE[i]."""


def layout(memory: str, dtype: str = "float32") -> KVLayout:
    return KVLayout(LAYERS, HEADS, DIM, dtype=dtype, block_size=BLOCK, memory=memory)


def random_kv(tokens: int, seed: int) -> torch.Tensor:
    """``[layers, 2, tokens, heads, dim]`` float32 values exact in every layout dtype (small integers)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8, (LAYERS, 2, tokens, HEADS, DIM), generator=generator).to(torch.float32)


def pool_value(kv: PagedKV, pool: list[torch.Tensor], layer: int, which: int, position: int) -> torch.Tensor:
    """One position's K or V read straight from the pool tensors (the layout's documented shapes)."""
    block, offset = TABLE[position // BLOCK], position % BLOCK
    if kv.layout.block_major:
        return pool[0][block, which, layer, offset]
    return pool[layer][block, which, offset]


@pytest.mark.parametrize("memory", ["block_major", "layer_major"])
@pytest.mark.parametrize("dtype", sorted(set(DTYPES) - {"uint8"}))
def test_write_then_read_every_position(memory: str, dtype: str) -> None:
    shape = layout(memory, dtype)
    pool = shape.allocate_pool(POOL_BLOCKS, "cpu")
    kv = PagedKV(shape, pool)
    values = random_kv(14, seed=1)
    for layer in range(LAYERS):
        kv.write(layer, TABLE, 0, values[layer, 0, :9], values[layer, 1, :9])  # a prefill ending mid-block
        kv.write(layer, TABLE, 9, values[layer, 0, 9:], values[layer, 1, 9:])  # the rest, crossing blocks
    for layer in range(LAYERS):
        for position in range(14):
            for which in (0, 1):
                got = pool_value(kv, pool, layer, which, position).to(torch.float32)
                assert torch.equal(got, values[layer, which, position]), (layer, which, position)
        keys, vals = kv.read(layer, torch.tensor(TABLE), 14, dtype=torch.float32)
        assert torch.equal(keys, values[layer, 0]) and torch.equal(vals, values[layer, 1])
    untouched = sorted(set(range(POOL_BLOCKS)) - set(TABLE))
    assert all(not bool(tensor[untouched].to(torch.float32).any()) for tensor in pool)


@pytest.mark.parametrize("memory", ["block_major", "layer_major"])
def test_read_blocks_returns_whole_blocks_per_layer(memory: str) -> None:
    shape = layout(memory)
    kv = PagedKV(shape, shape.allocate_pool(POOL_BLOCKS, "cpu"))
    values = random_kv(2 * BLOCK, seed=2)
    for layer in range(LAYERS):
        kv.write(layer, TABLE, 0, values[layer, 0], values[layer, 1])
    layers = kv.read_blocks(TABLE[:2])
    assert len(layers) == LAYERS
    for layer, (keys, vals) in enumerate(layers):
        assert keys.shape == (2, BLOCK, HEADS, DIM)
        assert torch.equal(keys.flatten(0, 1), values[layer, 0]) and torch.equal(vals.flatten(0, 1), values[layer, 1])


def test_uint8_pool_takes_bytes_only() -> None:
    shape = layout("block_major", "uint8")
    kv = PagedKV(shape, shape.allocate_pool(POOL_BLOCKS, "cpu"))
    raw = torch.arange(2 * HEADS * DIM, dtype=torch.uint8).view(2, HEADS, DIM)
    kv.write(0, TABLE, 0, raw, raw)
    assert torch.equal(kv.read(0, TABLE, 2)[0], raw)
    with pytest.raises(TypeError, match="uint8 pool takes uint8"):
        kv.write(0, TABLE, 0, raw.to(torch.float32), raw.to(torch.float32))


def test_bad_writes_are_refused() -> None:
    shape = layout("layer_major")
    kv = PagedKV(shape, shape.allocate_pool(POOL_BLOCKS, "cpu"))
    values = random_kv(BLOCK + 1, seed=3)
    with pytest.raises(ValueError, match="does not cover 5 positions"):
        kv.write(0, TABLE[:1], 0, values[0, 0], values[0, 1])
    with pytest.raises(ValueError, match=r"must both be \[tokens, 2, 4\]"):
        kv.write(0, TABLE, 0, values[0, 0, :, :1], values[0, 1, :, :1])
    with pytest.raises(ValueError, match="pool tensor"):
        PagedKV(shape, layout("block_major").allocate_pool(POOL_BLOCKS, "cpu"))


def test_blocks_needed_counts_a_partial_last_block() -> None:
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        blocks_needed(-1, 16)
