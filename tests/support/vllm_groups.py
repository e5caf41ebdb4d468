"""KV cache configs of hybrid models, made by vLLM's own planner (0.33) for ``support.vllm_connector.Instance``.

``kv_config_of(pattern)`` names each layer's attention (``F`` full, ``S`` a sliding
window of ``WINDOW`` tokens, ``M`` Mamba state) and returns a builder that hands
the layers' specs to vLLM's ``get_kv_cache_groups`` and
``get_kv_cache_config_from_groups``, as vLLM's engine core does at start: the
groups, block tables and shared tensors are vLLM's, with its hybrid allocator on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec, SlidingWindowSpec

from support.vllm_parts import BLOCK, HEAD_SIZE, KV_HEADS

LAYOUT = "LBHNC"
"""The CPU backend's layout (``support.vllm_connector.PAGE_SHAPE``)."""
WINDOW = 48
"""Tokens in a sliding window: its next token attends to 3 blocks of 16 before it (vLLM: ceil(47 / 16))."""
WINDOW_BLOCKS = 3
HYBRID_BLOCKS = 160
"""vLLM's pool, shared by every group: a 256-token chunk takes 16 blocks of each of four groups."""


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def layer_specs(pattern: str) -> dict[str, KVCacheSpec]:
    """Each layer's spec: ``F`` full attention, ``S`` sliding window, ``M`` Mamba state."""
    common = {"block_size": BLOCK, "num_kv_heads": KV_HEADS, "head_size": HEAD_SIZE, "dtype": torch.float32}
    specs: dict[str, KVCacheSpec] = {}
    for index, kind in enumerate(pattern):
        if kind == "F":
            specs[layer_name(index)] = FullAttentionSpec(**common)
        elif kind == "S":
            specs[layer_name(index)] = SlidingWindowSpec(**common, sliding_window=WINDOW)
        else:
            state = KV_HEADS * BLOCK * 2 * HEAD_SIZE  # one page's worth of float32 state
            specs[layer_name(index)] = MambaSpec(block_size=BLOCK, shapes=((state,),), dtypes=(torch.float32,))
    return specs


def kv_config_of(pattern: str, blocks: int = HYBRID_BLOCKS) -> Callable[[VllmConfig], KVCacheConfig]:
    """A builder of the KV cache config vLLM makes for layers of ``pattern`` (a pool of ``blocks`` blocks)."""

    def build(config: VllmConfig) -> KVCacheConfig:
        assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config), "vLLM would turn its allocator off"
        # what VllmConfig decides on a GPU platform (this CPU machine has none): the hybrid allocator stays on
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        config.cache_config.kv_cache_layout = LAYOUT  # what the engine core resolves for the CPU backend
        config.cache_config.num_gpu_blocks = blocks
        if "M" in pattern:  # Mamba without "align" state caching: vLLM's prefix caching off (as the CPU build runs)
            config.cache_config.enable_prefix_caching = False
        groups = get_kv_cache_groups(config, layer_specs(pattern))
        page = groups[0].kv_cache_spec.page_size_bytes
        per_block = page * max(len(group.layer_names) for group in groups)
        return get_kv_cache_config_from_groups(config, groups, blocks * per_block)

    return build
