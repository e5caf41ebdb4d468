"""The token map of FlashAttention's pages under vLLM 0.33's own specs: K and V written where FlashAttention's forward
reads them (``kv_cache.transpose(1, 2).split(head_size, -1)`` of the logical ``[blocks, heads, tokens, 2 * head]``
view, laid out token-major as its LBNHC cache is), copied into a slot as the connector's page map reads a page, and
read back through the token map, are the K and V written, for a rank of a TP pair too."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.pages import page_view
from tiercache.integrations.vllm.connector.token_order import INTERLEAVED_BACKENDS, token_order

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD, BLOCK, NUM_BLOCKS = 2, 64, 16, 4


def flash_cache(dtype: torch.dtype) -> torch.Tensor:
    """Every layer's ``[blocks, heads, tokens, 2 * head]`` logical view over a token-major (LBNHC) storage."""
    storage = torch.zeros(len(LAYERS), NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD, dtype=dtype)
    return storage.permute(0, 1, 3, 2, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world", [1, 2])
def test_flash_attention_pages_read_through_the_map_are_the_k_and_v_it_wrote(dtype: torch.dtype, world: int) -> None:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)], kv_cache_layout="LBNHC")
    page = spec.page_size_bytes
    geometry = SlotGeometry((GroupGeometry(GroupKind.FULL, LAYERS, page),), world, BLOCK,
                            str(dtype).removeprefix("torch."), HEAD)
    order = token_order(None, config, geometry)  # not the CPU platform: the config is not read
    assert order.backends == INTERLEAVED_BACKENDS and order.token_map is not None
    generator = torch.Generator().manual_seed(world)
    keys = torch.randn(world, len(LAYERS), BLOCK, HEADS, HEAD, generator=generator).to(dtype)
    values = torch.randn(world, len(LAYERS), BLOCK, HEADS, HEAD, generator=generator).to(dtype)
    slot = torch.empty(world, len(LAYERS), page, dtype=torch.uint8)
    for rank in range(world):
        caches = flash_cache(dtype)
        for layer, name in enumerate(LAYERS):
            key_cache, value_cache = caches[layer].transpose(1, 2).split(HEAD, dim=-1)  # flash_attn.py's own split
            key_cache[2], value_cache[2] = keys[rank, layer], values[rank, layer]
            slot[rank, layer] = page_view(name, caches[layer], page, NUM_BLOCKS)[2].flatten()
    read = slot.view(dtype).flatten()[order.token_map.index()]  # [layers, 2, tokens, ranks * heads * head]
    ranks_after_tokens = (1, 2, 0, 3, 4)  # [layers, tokens, rank, heads, head]: a rank's heads follow the last's
    assert torch.equal(read[:, 0], keys.permute(*ranks_after_tokens).flatten(-3))
    assert torch.equal(read[:, 1], values.permute(*ranks_after_tokens).flatten(-3))
