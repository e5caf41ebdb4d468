"""The tiercache namespace of a vLLM instance's slots: the model's identity and the page format, the same on both sides.

Two instances share a block exactly when everything below agrees: the model
(``model_identity``: the core's one rule, ``tiercache.blocks.model_identity``:
vLLM's effective config, quantization, dtype and a digest of the checkpoint's
weights, never its name or path), the device type, the dtypes, the block size,
the groups (their kinds, windows and layers), the page's heads, head sizes and
bytes, and the parallel sizes; not the physical layout (LBNHC, LBHNC, ...
share: ``pages`` keeps vLLM's logical page order). Each (head, token) cell's
content is vLLM's and copied as opaque bytes (on CPU it differs by the kernel's
instruction set: K is stored transposed there, so the instruction set is part of
the format). The namespace is built by the core's one builder
(``tiercache.blocks.namespaces.engine_namespace``); a slot holds every rank's
pages, so its rank is 0. A request's ``cache_salt`` and LoRA go into each
chain's keys (``block_extra``).
"""

from __future__ import annotations

import json
from typing import Any

from tiercache.blocks.model_identity import ModelIdentity, checkpoint_identity
from tiercache.blocks.namespaces import PageFormat
from tiercache.integrations.vllm.connector.geometry import SlotGeometry, spec_name

ENGINE = "vllm-connector"
"""The page format's engine: slots of vLLM pages as this connector lays them out."""
SLOT_FORMAT = "pages in vLLM's logical [heads, tokens, content] order, v2"
"""How a slot's pages are ordered: vLLM's logical page, whatever the physical layout (``pages``), so instances on
different KV layouts share blocks; the physical layout is deliberately not part of the namespace."""


def page_format(vllm_config: Any, kv_cache_config: Any, geometry: SlotGeometry) -> PageFormat:
    """Everything that fixes the bytes of a slot (beyond the model): per group its spec, window, layers and page."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    fields = {
        "device": device,
        "model_dtype": str(model.dtype),
        "cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "slot_format": SLOT_FORMAT,
        "block_size": geometry.block_size,
        "world": geometry.world,
        "groups": [
            {
                "spec": spec_name(spec),
                "kind": group.kind.value,
                "window": int(getattr(spec, "sliding_window", 0) or 0),
                "window_blocks": group.window_blocks,
                "kv_dtype": str(getattr(spec, "dtype", "")),
                "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
                "head_size": int(getattr(spec, "head_size", 0)),
                "head_size_v": int(getattr(spec, "head_size_v", 0) or 0),
                "page_bytes": group.page_bytes,
                "replicated": group.replicated,
                "layers": list(group.layer_names),
                **_state_fields(spec),
            }
            for spec, group in zip(specs, geometry.groups, strict=True)
        ],
    }
    if device == "cpu":
        attention = next((spec for spec in specs if hasattr(spec, "num_kv_heads")), specs[0])
        fields["cpu_attention_isa"] = _cpu_attention_isa(attention, cache)
    return PageFormat(ENGINE, fields)


def _state_fields(spec: Any) -> dict[str, Any]:
    """A state group's tensors (shapes, dtypes) and kind of state layer; nothing for attention (its namespaces stay
    as they were)."""
    if not hasattr(spec, "shapes"):
        return {}
    tensors = [[list(shape), str(dtype)] for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)]
    return {"state": tensors, "state_type": str(getattr(spec, "mamba_type", "")),
            "state_cache_mode": str(getattr(spec, "mamba_cache_mode", ""))}


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


def block_extra(cache_salt: str | None, lora_name: str | None) -> str | None:
    """What a request adds to each of its chain's keys: its tenant salt and LoRA adapter (None: neither)."""
    if not cache_salt and not lora_name:
        return None
    return json.dumps({"cache_salt": cache_salt or "", "lora": lora_name or ""}, sort_keys=True)
