"""The tiercache namespace of a vLLM instance, from its ``OffloadingConfig`` (never its ``engine_id``).

Two vLLM instances share a chunk's KV exactly when everything that fixes the
chunk's bytes agrees: the model (the core's ``ModelIdentity`` of the checkpoint
vLLM serves, ``tiercache.blocks.model_identity``: its ``config.json`` and a
digest of its weights; ``OffloadingConfig`` names the model only by its path or
hub id, so a name no local checkpoint answers to stands for the weights, and
vLLM's ``--quantization`` and ``--hf-overrides`` do not reach this tier: serve
such variants under checkpoints of their own), the KV dtype, tokens per hash and blocks per
chunk, the bytes of a chunk in the primary tier, the KV-cache groups and their
layers, the parallel sizes (TP, PP, PCP, DCP, world) and the rank, and vLLM's
layout choices (replicated, canonical). ``engine_id`` differs per instance and
the data-parallel index per replica: neither is part of it, so replicas and
restarts share entries. The topology's ``model.secret_env`` keys it (in
``RemoteStore``, ``tiercache.remote.secret``): instances with different secrets never share.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from tiercache.blocks.keys import Namespace
from tiercache.blocks.model_identity import checkpoint_identity
from tiercache.blocks.namespaces import PageFormat, engine_namespace

ENGINE = "vllm-offloading"
"""The page format's engine: chunks of vLLM's own CPU tier, as its offloading spec lays them out."""


def namespace_fields(config: OffloadingConfig, chunk_bytes: int) -> dict[str, Any]:
    """Everything of ``config`` (and the primary's bytes per chunk) that must match to share a chunk."""
    parallel = config.parallel
    return {
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "chunk_bytes": chunk_bytes,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "groups": [[group.tokens_per_block, list(group.layer_names)] for group in config.groups],
        "world_size": parallel.world_size,
        "tp_size": parallel.tp_size,
        "pp_size": parallel.pp_size,
        "pcp_size": parallel.pcp_size,
        "dcp_size": parallel.dcp_size,
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
    }


def offloading_namespace(config: OffloadingConfig, chunk_bytes: int) -> Namespace:
    """The namespace (the core's one builder): the model's identity, ``namespace_fields`` and the parallel rank."""
    identity = checkpoint_identity(config.model.name, config.model.dtype)
    return engine_namespace(identity, PageFormat(ENGINE, namespace_fields(config, chunk_bytes)), config.parallel.rank)
