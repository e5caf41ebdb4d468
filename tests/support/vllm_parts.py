"""The parts of a vLLM instance the connector's tests build (vLLM 0.33): the tiny model's directory, a real
``VllmConfig`` with the connector, the KV cache spec and CPU KV tensors, and connector topologies with a CPU tier
and Redis or simulated remotes. ``support.vllm_connector`` drives an instance built from them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tiercache.testing.tiny_llama import tiny_llama_config

BLOCK = 16
"""Tokens per vLLM block."""
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS, HEAD_SIZE = 1, 8
NUM_BLOCKS = 64
"""vLLM's own pool, in blocks (small: a test sees what it frees and reuses)."""
PAGE_SHAPE = (KV_HEADS, BLOCK, 2 * HEAD_SIZE)
"""A block's page of one layer as vLLM's CPU backend lays it out (``[H, N, 2D]``, LBHNC)."""
CONNECTOR = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.integrations.vllm.connector"}
_STORES = itertools.count()


def model_dir(root: Path, name: str = "m", vocab_size: int = 512) -> Path:
    """A model directory with a tiny Llama's ``config.json`` only (vLLM reads no weights here)."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_llama_config(hidden_size=64, num_layers=len(LAYERS), num_heads=2, num_kv_heads=KV_HEADS,
                               vocab_size=vocab_size, max_position_embeddings=1024)
    config.save_pretrained(directory)
    return directory


def cpu_topology(blocks: int = 48, remotes: Iterable[dict[str, Any]] = (), **top: Any) -> dict[str, Any]:
    """A connector topology: a CPU tier of ``blocks`` slots, then ``remotes``."""
    return {"tiers": [{"type": "cpu", "capacity_blocks": blocks}, *remotes], **top}


def vllm_config(model: Path, engine_id: str, extra: dict[str, Any], *, kv_role: str = "kv_both",
                events: KVEventsConfig | None = None, tensor_parallel_size: int = 1,
                micro_batched: bool = False) -> VllmConfig:
    """The smallest real ``VllmConfig`` with the connector (float32, prefix caching, chunked prefill);
    ``micro_batched``: vLLM's dual-batch overlap on."""
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=1024)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(**CONNECTOR, kv_role=kv_role, engine_id=engine_id,
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"),
        kv_events_config=events,
    )
    config.parallel_config.tensor_parallel_size = tensor_parallel_size
    config.parallel_config.enable_dbo = micro_batched
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def kv_cache_config(layers: Iterable[str] = LAYERS) -> KVCacheConfig:
    """One group of full attention over ``layers``, as vLLM's engine core resolves it for the CPU backend."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(layers),
                         spec)], kv_cache_layout="LBHNC")


def kv_tensors(config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """vLLM's CPU KV cache, filled with a marker: one ``[blocks, H, N, 2D]`` view per layer of one storage, or
    where ``config.kv_cache_tensors`` places the layers (vLLM's planner: an allocation, strides per layer and
    block), a view per layer of its allocation."""
    if not config.kv_cache_tensors:
        names = [name for group in config.kv_cache_groups for name in group.layer_names]
        storage = torch.full((len(names), config.num_blocks, *PAGE_SHAPE), -1.0, dtype=torch.float32)
        return {name: storage[i] for i, name in enumerate(names)}
    kv = {}
    item = torch.float32.itemsize
    page = [KV_HEADS * BLOCK * 2 * HEAD_SIZE, BLOCK * 2 * HEAD_SIZE, 2 * HEAD_SIZE, 1]  # a page's own strides
    for tensor in config.kv_cache_tensors:
        backing = torch.full((tensor.size // item,), -1.0, dtype=torch.float32)
        for index, name in enumerate(tensor.layers):
            start = (tensor.offset + index * tensor.layer_stride) // item
            shape = (config.num_blocks, *PAGE_SHAPE)
            kv[name] = backing.as_strided(shape, (tensor.block_stride // item, *page[1:]), start)
    return kv


def redis_remote(url: str) -> dict[str, Any]:
    return {"type": "redis", "name": "redis", "options": {"url": url}}


def simulated_remote(store: str | None = None, **options: Any) -> dict[str, Any]:
    """A simulated remote over ``store`` (by default a store no other remote of the run shares)."""
    store = fresh_store() if store is None else store
    return {"type": "simulated", "name": "sim", "options": {"store": store, "latency_ms": 0, **options}}


def fresh_store() -> str:
    """A simulated store's name no other test of the run uses (for remotes that must share one)."""
    return f"connector-{next(_STORES)}"
