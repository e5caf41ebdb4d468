"""What fixes a block's bytes in a vLLM instance: its slot geometry and tiercache namespace, the same on both sides.

The scheduler side sizes the CPU tier's slots and hashes keys with it; each worker
checks its KV tensors against it before it copies a byte. A slot holds one vLLM
block of every layer of every tensor-parallel rank (``[rank][layer][page]``), so
one key names the whole block; a page's interior is vLLM's (it differs by
attention backend and, on CPU, by the kernel's instruction set: K is stored
transposed there) and is copied as opaque bytes, never reinterpreted.

Two instances share a block exactly when everything below agrees: the model
(its directory's name, revision, and a digest of its config and of its weight
files' names, sizes and leading and trailing bytes, so two deployments serving
other weights under one name, or one directory name, never share), the
dtypes, the block size, the layers, the page's shape and bytes, the backend's
layout and the parallel sizes. A request's ``cache_salt`` and LoRA go into each
chain's keys (``block_extra``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
"""Files whose names and sizes stand for a model directory's weights in its identity."""
IDENTITY_FILES = ("config.json", "generation_config.json")
"""Small files of a model directory whose content is part of its identity."""
WEIGHT_SAMPLE_BYTES = 1 << 20
"""Bytes read from each end of a weight file for the model's digest."""
DIGEST_HEX = 32
"""Hex digits of the model and layout digests (128 bits of SHA-256)."""


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


def model_digest(model: str) -> str:
    """A digest of a local model directory (of the name alone when it is not one): its identity files' content,
    and per weight file its name, size and first and last ``WEIGHT_SAMPLE_BYTES`` (weights of one shape differ
    there; their mtimes do not count, so copies on other hosts agree, and reading the samples is cheap)."""
    directory = Path(model)
    if not directory.is_dir():
        return hashlib.sha256(model.encode()).hexdigest()[:DIGEST_HEX]
    digest = hashlib.sha256()
    for name in IDENTITY_FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES):
            size = path.stat().st_size
            digest.update(f"{path.relative_to(directory)}:{size}".encode())
            with path.open("rb") as weights:
                digest.update(weights.read(WEIGHT_SAMPLE_BYTES))
                weights.seek(max(0, size - WEIGHT_SAMPLE_BYTES))
                digest.update(weights.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()[:DIGEST_HEX]


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


def model_id(vllm_config: Any, kv_cache_config: Any, geometry: SlotGeometry) -> str:
    """The namespace's model id: the model's name, revision and digest, and the digest of its page format."""
    model = vllm_config.model_config
    path = model.model
    resolved = os.path.realpath(path) if os.path.isdir(path) else path
    fields = json.dumps(page_format(vllm_config, kv_cache_config, geometry), sort_keys=True, separators=(",", ":"))
    layout = hashlib.sha256(fields.encode()).hexdigest()[:DIGEST_HEX]
    return f"{Path(resolved).name}@{model.revision or '-'}:{model_digest(resolved)}:vllm-{layout}"


def block_extra(cache_salt: str | None, lora_name: str | None) -> str | None:
    """What a request adds to each of its chain's keys: its tenant salt and LoRA adapter (None: neither)."""
    if not cache_salt and not lora_name:
        return None
    return json.dumps({"cache_salt": cache_salt or "", "lora": lora_name or ""}, sort_keys=True)
