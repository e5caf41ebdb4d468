"""What fixes a block's bytes in a vLLM instance: its slot geometry and tiercache namespace, the same on both sides.

The scheduler side sizes the CPU tier's slots and hashes keys with it; each worker
checks its KV tensors against it before it copies a byte. vLLM splits a model's
layers into KV-cache groups (one block table each: full attention, a sliding
window, Mamba state; docs/engines.md, "Hybrid and sliding-window models"). A slot holds
one vLLM block of one group: that group's layers of every tensor-parallel rank
(``[rank][layer of the group][page]``; MLA's replicated latent once), so one key
names a block of one group. A page is kept in vLLM's logical order
(``[heads, tokens, content]``, RFC #42082) whatever the physical KV layout
(``pages``); each (head, token) cell's content is vLLM's and copied as opaque
bytes (on CPU it differs by the kernel's instruction set: K is stored
transposed there).

Two instances share a block exactly when everything below agrees: the model
(``model_identity``: the core's one rule, ``tiercache.blocks.model_identity``:
vLLM's effective config, quantization, dtype and a digest of the checkpoint's
weights, never its name or path), the device type, the dtypes, the block size,
the groups (their kinds, windows and layers), the page's heads, head sizes and
bytes, and the parallel sizes; not the physical layout (LBNHC, LBHNC, ...
share). A request's ``cache_salt`` and LoRA go into each chain's keys
(``block_extra``).
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tiercache.blocks.model_identity import ModelIdentity, checkpoint_identity

DIGEST_HEX = 32
"""Hex digits of the page format's digest (128 bits of SHA-256)."""
FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
SLOT_FORMAT = "pages in vLLM's logical [heads, tokens, content] order, v2"
"""How a slot's pages are ordered: vLLM's logical page, whatever the physical layout (``pages``), so instances on
different KV layouts share blocks; the physical layout is deliberately not part of the namespace."""
REPLICATED_SPECS = ("MLAAttentionSpec",)
"""vLLM KV cache specs whose pages every tensor-parallel rank holds alike (one latent head, not split by rank)."""
"""vLLM KV cache specs whose groups keep every block of a prefix."""
SLIDING_SPECS = ("SlidingWindowSpec",)
"""vLLM KV cache specs whose groups keep only the blocks inside an attention window."""


class UnsupportedLayoutError(ValueError):
    """A vLLM KV cache the connector cannot copy as whole pages (said before anything is copied)."""


class GroupKind(enum.Enum):
    """What a KV-cache group's blocks hold, as far as a hit is concerned."""

    FULL = "full"
    """Every block of the prefix: a hit of N blocks needs all N."""
    SLIDING = "sliding"
    """Only the blocks inside the window: a hit of N blocks needs the last ``window_blocks`` before N."""


@dataclass(frozen=True)
class GroupGeometry:
    """One vLLM KV-cache group: its layers, the bytes of one layer's page, and what a hit needs of it."""

    kind: GroupKind
    layer_names: tuple[str, ...]
    page_bytes: int
    window_blocks: int = 0
    """Sliding window: the blocks before a hit's end that its next token attends to (vLLM's own count)."""
    replicated: bool = False
    """Every tensor-parallel rank holds the same pages (MLA's latent KV): a slot keeps one copy, rank 0 stores it,
    every rank loads it."""

    @property
    def layers_bytes(self) -> int:
        """One block of this group on one rank: every layer's page."""
        return len(self.layer_names) * self.page_bytes


@dataclass(frozen=True)
class SlotGeometry:
    """How a CPU slot holds one vLLM block of one group: ``world`` ranks x that group's pages."""

    groups: tuple[GroupGeometry, ...]
    world: int
    block_size: int

    @property
    def rank_bytes(self) -> int:
        """A rank's share of a slot: the largest group's pages of one block."""
        return max(group.layers_bytes for group in self.groups)

    @property
    def copies(self) -> int:
        """Rank shares in a slot: one per rank, or one for all when every group is replicated (MLA)."""
        return 1 if all(group.replicated for group in self.groups) else self.world

    @property
    def slot_bytes(self) -> int:
        return self.copies * self.rank_bytes

    def writes(self, rank: int, group: int) -> bool:
        """Whether rank ``rank`` stores its pages of ``group`` (a replicated group: rank 0 only)."""
        return rank == 0 or not self.groups[group].replicated

    def group_bytes(self, group: int) -> int:
        """The bytes one block of ``group`` moves between vLLM and a slot, over every rank that copies it."""
        spec = self.groups[group]
        return spec.layers_bytes * (1 if spec.replicated else self.world)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer the connector copies, group by group."""
        return tuple(name for group in self.groups for name in group.layer_names)

    @property
    def hybrid(self) -> bool:
        """Whether a hit needs more than a prefix of one kind of block (a sliding window or several groups)."""
        return any(group.kind is GroupKind.SLIDING for group in self.groups)

    def offset(self, rank: int, group: int, layer: int) -> int:
        """Where rank ``rank``'s page of layer ``layer`` (its index in group ``group``) starts in a slot (a replicated
        group: rank 0's, for every rank)."""
        spec = self.groups[group]
        return (0 if spec.replicated else rank) * self.rank_bytes + layer * spec.page_bytes


@dataclass(frozen=True)
class InstanceGeometry:
    """What the connector does for an instance: copy blocks by ``slots``, or decline every request (``declined``)."""

    slots: SlotGeometry | None
    declined: str | None = None
    """Why the connector declines every request of this model (None: it serves them)."""


def _spec_name(spec: Any) -> str:
    return type(spec).__name__


def describe_groups(kv_cache_config: Any) -> str:
    """vLLM's KV-cache groups in one line, for the log: index, spec, window, layers."""
    parts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        shown = f"(window {window})" if isinstance(window, int) else ""
        parts.append(f"g{index} {_spec_name(spec)}{shown} x{len(group.layer_names)} layers")
    return "; ".join(parts)


def instance_geometry(vllm_config: Any, kv_cache_config: Any) -> InstanceGeometry:
    """The slot geometry of an instance, or why it declines every request (``UnsupportedLayoutError``: a parallel
    layout the connector refuses at startup)."""
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) != 1:
            raise UnsupportedLayoutError(f"tiercache's connector supports {name} 1 only, got {getattr(parallel, name)}")
    groups = kv_cache_config.kv_cache_groups
    block_sizes = {int(group.kv_cache_spec.block_size) for group in groups}
    known = FULL_SPECS + SLIDING_SPECS
    others = [_spec_name(g.kv_cache_spec) for g in groups if _spec_name(g.kv_cache_spec) not in known]
    if others:
        return InstanceGeometry(None, f"its KV-cache groups hold {sorted(set(others))}: state (Mamba, linear "
                                "attention) or blocks tiercache does not restore, so KV of its attention layers alone "
                                "would be wrong")
    if len(block_sizes) != 1:
        return InstanceGeometry(None, f"its KV-cache groups have block sizes {sorted(block_sizes)}; tiercache keys "
                                "one block size per instance")
    block_size = block_sizes.pop()
    speculative = getattr(vllm_config, "speculative_config", None)
    eagle = bool(speculative is not None and speculative.use_eagle())
    geometries = []
    for group in groups:
        spec = group.kv_cache_spec
        if _spec_name(spec) in SLIDING_SPECS:
            if getattr(spec, "extra_retained_tokens", 0):
                return InstanceGeometry(None, "a sliding window that retains blocks below it (multi-token "
                                        "prediction) keeps blocks tiercache would not fill")
            window = -(-(int(spec.sliding_window) - 1) // block_size) + int(eagle)  # vLLM's contiguous blocks
            geometries.append(GroupGeometry(GroupKind.SLIDING, tuple(group.layer_names), _page_bytes(spec), window))
        else:
            geometries.append(GroupGeometry(GroupKind.FULL, tuple(group.layer_names), _page_bytes(spec),
                                            replicated=_spec_name(spec) in REPLICATED_SPECS))
    return InstanceGeometry(SlotGeometry(tuple(geometries), int(parallel.tensor_parallel_size), block_size))


def _page_bytes(spec: Any) -> int:
    """The bytes of a page a slot keeps: vLLM's unpadded page (a padded page's tail holds nothing)."""
    return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))


def page_format(vllm_config: Any, kv_cache_config: Any, geometry: SlotGeometry) -> dict[str, Any]:
    """Everything that fixes the bytes of a slot (beyond the model), as plain data: per group its spec, window,
    layers and page."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    fields = {
        "engine": "vllm-connector",
        "device": device,
        "model_dtype": str(model.dtype),
        "cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "slot_format": SLOT_FORMAT,
        "block_size": geometry.block_size,
        "world": geometry.world,
        "groups": [
            {
                "spec": _spec_name(spec),
                "kind": group.kind.value,
                "window": int(getattr(spec, "sliding_window", 0) or 0),
                "window_blocks": group.window_blocks,
                "kv_dtype": str(spec.dtype),
                "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
                "head_size": int(getattr(spec, "head_size", 0)),
                "head_size_v": int(getattr(spec, "head_size_v", 0) or 0),
                "page_bytes": group.page_bytes,
                "replicated": group.replicated,
                "layers": list(group.layer_names),
            }
            for spec, group in zip(specs, geometry.groups, strict=True)
        ],
    }
    if device == "cpu":
        fields["cpu_attention_isa"] = _cpu_attention_isa(specs[0], cache)
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
