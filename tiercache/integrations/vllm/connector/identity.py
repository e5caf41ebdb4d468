"""What fixes a block's bytes in a vLLM instance: its slot geometry and tiercache namespace, the same on both sides.

The scheduler side sizes the CPU tier's slots and hashes keys with it; each worker
checks its KV tensors against it before it copies a byte. A slot holds one vLLM
block of every layer of every tensor-parallel rank (``[rank][layer][page]``), so
one key names the whole block; a page's interior is vLLM's (it differs by
attention backend and, on CPU, by the kernel's instruction set: K is stored
transposed there) and is copied as opaque bytes, never reinterpreted.

Two instances share a block exactly when everything below agrees: the model
(``model_identity``: the core's one rule, ``tiercache.blocks.model_identity``:
vLLM's effective config, quantization, dtype and a digest of the checkpoint's
weights, never its name or path), the dtypes, the block size, the layers, the
page's shape and bytes, the backend's layout and the parallel sizes. A
request's ``cache_salt`` and LoRA go into each chain's keys (``block_extra``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tiercache.blocks.model_identity import ModelIdentity, checkpoint_identity

DIGEST_HEX = 32
"""Hex digits of the page format's digest (128 bits of SHA-256)."""


class UnsupportedLayoutError(ValueError):
    """A vLLM KV cache the connector cannot copy as whole pages of one group (said before anything is copied)."""


@dataclass(frozen=True)
class SlotGeometry:
    """How a CPU slot holds one vLLM block: ``world`` ranks x ``layers`` pages of ``page_bytes``."""

    layer_names: tuple[str, ...]
    page_bytes: int
    world: int
    block_size: int

    @property
    def rank_bytes(self) -> int:
        return len(self.layer_names) * self.page_bytes

    @property
    def slot_bytes(self) -> int:
        return self.world * self.rank_bytes

    def offset(self, rank: int, layer: int) -> int:
        """Where rank ``rank``'s page of layer ``layer`` starts in a slot."""
        return rank * self.rank_bytes + layer * self.page_bytes


def slot_geometry(vllm_config: Any, kv_cache_config: Any) -> SlotGeometry:
    """The slot geometry of an instance (``UnsupportedLayoutError`` for a KV cache the connector refuses)."""
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) != 1:
            raise UnsupportedLayoutError(f"tiercache's connector supports {name} 1 only, got {getattr(parallel, name)}")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedLayoutError(
            f"tiercache's connector needs one KV cache group (plain attention in every layer); this model has "
            f"{len(groups)} ({[type(group.kv_cache_spec).__name__ for group in groups]})"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ not in ("FullAttentionSpec", "MLAAttentionSpec"):
        raise UnsupportedLayoutError(f"tiercache's connector copies full-attention KV only, not {type(spec).__name__}")
    return SlotGeometry(
        tuple(groups[0].layer_names), int(spec.page_size_bytes), int(parallel.tensor_parallel_size),
        int(spec.block_size),
    )


def page_format(vllm_config: Any, kv_cache_config: Any, geometry: SlotGeometry) -> dict[str, Any]:
    """Everything that fixes the bytes of a page (beyond the model), as plain data."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    fields = {
        "engine": "vllm-connector",
        "device": device,
        "model_dtype": str(model.dtype),
        "kv_dtype": str(spec.dtype),
        "cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "spec": type(spec).__name__,
        "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
        "head_size": int(getattr(spec, "head_size", 0)),
        "kv_cache_layout": str(kv_cache_config.kv_cache_layout),
        "page_bytes": geometry.page_bytes,
        "block_size": geometry.block_size,
        "layers": list(geometry.layer_names),
        "world": geometry.world,
    }
    if device == "cpu":
        fields["cpu_attention_isa"] = _cpu_attention_isa(spec, cache)
    return fields


def _cpu_attention_isa(spec: Any, cache: Any) -> str:
    """The kernel family vLLM's CPU attention packs pages for (its K/V interior differs by family)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return "unknown"
    try:
        return str(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size, getattr(cache, "cache_dtype", None)))
    except Exception as error:  # an ISA the kernel refuses is not one pages could be shared under
        return f"unavailable: {error}"


def model_identity(vllm_config: Any) -> ModelIdentity:
    """The served model's identity: vLLM's effective config (overrides included), quantization, dtype, weights."""
    model = vllm_config.model_config
    overrides = model.hf_overrides if isinstance(model.hf_overrides, dict) else repr(model.hf_overrides)
    return checkpoint_identity(
        model.model, str(model.dtype), config=model.hf_config.to_dict(), revision=model.revision,
        settings={"quantization": model.quantization, "hf_overrides": overrides},
        cache_dir=getattr(vllm_config.load_config, "download_dir", None),
    )


def model_id(vllm_config: Any, kv_cache_config: Any, geometry: SlotGeometry) -> str:
    """The namespace's model id: the model's identity and the digest of its page format."""
    fields = json.dumps(page_format(vllm_config, kv_cache_config, geometry), sort_keys=True, separators=(",", ":"))
    layout = hashlib.sha256(fields.encode()).hexdigest()[:DIGEST_HEX]
    return f"{model_identity(vllm_config).model_id}:vllm-{layout}"


def block_extra(cache_salt: str | None, lora_name: str | None) -> str | None:
    """What a request adds to each of its chain's keys: its tenant salt and LoRA adapter (None: neither)."""
    if not cache_salt and not lora_name:
        return None
    return json.dumps({"cache_salt": cache_salt or "", "lora": lora_name or ""}, sort_keys=True)
