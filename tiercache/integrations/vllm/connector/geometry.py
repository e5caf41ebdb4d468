"""The slot geometry of a vLLM instance: how a CPU slot holds one vLLM block of one KV-cache group, or why not.

The scheduler side sizes the CPU tier's slots with it; each worker checks its KV
tensors against it before it copies a byte. vLLM splits a model's layers into
KV-cache groups (one block table each: full attention, a sliding window, Mamba
state; docs/engines.md, "Hybrid and sliding-window models"). A slot holds one
vLLM block of one group: that group's layers of every tensor-parallel rank
(``[rank][layer of the group][page]``; MLA's replicated latent once), so one key
names a block of one group. A page is kept in vLLM's logical order (``pages``).
Plain data read from vLLM's configs: torch and vLLM are not imported (the GPU
check runs this on a machine without vLLM).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from tiercache.blocks.layout import DTYPES

FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
"""vLLM KV cache specs whose groups keep every block of a prefix."""
REPLICATED_SPECS = ("MLAAttentionSpec",)
"""vLLM KV cache specs whose pages every tensor-parallel rank holds alike (one latent head, not split by rank)."""
SLIDING_SPECS = ("SlidingWindowSpec",)
"""vLLM KV cache specs whose groups keep only the blocks inside an attention window."""
STATE_SPECS = ("MambaSpec",)
"""vLLM KV cache specs whose groups keep a state layer's state (Mamba, gated delta net, short convolutions)."""
ALIGN_MODE = "align"
"""vLLM's ``mamba_cache_mode`` that keeps, in block ``p`` of a state group, the state after exactly ``p + 1``
blocks (``vllm/v1/core/sched/scheduler.py``: "slot p holds the state after exactly (p + 1) * block_size tokens")."""
ELEMENT_DTYPES = frozenset(DTYPES) - {"uint8"}
"""KV cache dtypes whose elements the connector names to the codec (vLLM's fp8 caches as uint8 stay bytes)."""


class UnsupportedLayoutError(ValueError):
    """A vLLM KV cache the connector cannot copy as whole pages (said before anything is copied)."""


class GroupKind(enum.Enum):
    """What a KV-cache group's blocks hold, as far as a hit is concerned."""

    FULL = "full"
    """Every block of the prefix: a hit of N blocks needs all N."""
    SLIDING = "sliding"
    """Only the blocks inside the window: a hit of N blocks needs the last ``window_blocks`` before N."""
    STATE = "state"
    """One state per block boundary (vLLM's align mode): a hit of N blocks needs block N - 1, the state after N
    blocks (``window_blocks`` 1)."""


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
    element_dtype: str | None = None
    """The KV cache's element dtype, the same in every group (None: groups differ, or not a float)."""
    group_elements: int | None = None
    """Elements per quantization group: the head sizes' greatest common divisor (the innermost, contiguous
    dimension of every vLLM attention layout), so no group straddles a head, K and V, a page or a rank's share."""

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
        return any(group.kind is not GroupKind.FULL for group in self.groups)

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


def spec_name(spec: Any) -> str:
    return type(spec).__name__


def describe_groups(kv_cache_config: Any) -> str:
    """vLLM's KV-cache groups in one line, for the log: index, spec, window, layers."""
    parts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        shown = f"(window {window})" if isinstance(window, int) else ""
        parts.append(f"g{index} {spec_name(spec)}{shown} x{len(group.layer_names)} layers")
    return "; ".join(parts)


def instance_geometry(vllm_config: Any, kv_cache_config: Any) -> InstanceGeometry:
    """The slot geometry of an instance, or why it declines every request (``UnsupportedLayoutError``: a parallel
    layout the connector refuses at startup)."""
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) != 1:
            raise UnsupportedLayoutError(f"tiercache's connector supports {name} 1 only, got {getattr(parallel, name)}")
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "calculate_kv_scales", False) and str(getattr(cache, "cache_dtype", "")).startswith("fp8"):
        return InstanceGeometry(None, "its FP8 KV cache's scales are computed from its first batch "
                                "(calculate_kv_scales): another instance's pages, stored under other scales, would "
                                "read wrong")
    groups = kv_cache_config.kv_cache_groups
    block_sizes = {int(group.kv_cache_spec.block_size) for group in groups}
    known = FULL_SPECS + SLIDING_SPECS + STATE_SPECS
    others = [spec_name(g.kv_cache_spec) for g in groups if spec_name(g.kv_cache_spec) not in known]
    if others:
        return InstanceGeometry(None, f"its KV-cache groups hold {sorted(set(others))}: blocks tiercache does not "
                                "restore, so KV of its other layers alone would be wrong")
    states = [g.kv_cache_spec for g in groups if spec_name(g.kv_cache_spec) in STATE_SPECS]
    refused = _state_refusal(vllm_config, kv_cache_config, states) if states else None
    if refused is not None:
        return InstanceGeometry(None, refused)
    if len(block_sizes) != 1:
        return InstanceGeometry(None, f"its KV-cache groups have block sizes {sorted(block_sizes)}; tiercache keys "
                                "one block size per instance")
    block_size = block_sizes.pop()
    speculative = getattr(vllm_config, "speculative_config", None)
    eagle = bool(speculative is not None and speculative.use_eagle())
    geometries = []
    for group in groups:
        spec = group.kv_cache_spec
        if spec_name(spec) in SLIDING_SPECS:
            if getattr(spec, "extra_retained_tokens", 0):
                return InstanceGeometry(None, "a sliding window that retains blocks below it (multi-token "
                                        "prediction) keeps blocks tiercache would not fill")
            window = -(-(int(spec.sliding_window) - 1) // block_size) + int(eagle)  # vLLM's contiguous blocks
            geometries.append(GroupGeometry(GroupKind.SLIDING, tuple(group.layer_names), _page_bytes(spec), window))
        elif spec_name(spec) in STATE_SPECS:
            geometries.append(GroupGeometry(GroupKind.STATE, tuple(group.layer_names), _page_bytes(spec), 1,
                                            replicated=bool(getattr(spec, "tp_replicated", False))))
        else:
            geometries.append(GroupGeometry(GroupKind.FULL, tuple(group.layer_names), _page_bytes(spec),
                                            replicated=spec_name(spec) in REPLICATED_SPECS))
    dtype, group = _elements([group.kv_cache_spec for group in groups], geometries)
    return InstanceGeometry(SlotGeometry(tuple(geometries), int(parallel.tensor_parallel_size), block_size, dtype,
                                         group))


def _state_refusal(vllm_config: Any, kv_cache_config: Any, states: list[Any]) -> str | None:
    """Why the connector cannot save and restore these state groups (None: it can: vLLM's align mode, one state
    per block boundary, hits on whole blocks)."""
    modes = {str(getattr(spec, "mamba_cache_mode", "none")) for spec in states}
    if modes != {ALIGN_MODE}:
        return (f"its state layers (Mamba, linear attention) keep their state in mamba_cache_mode {sorted(modes)}: "
                "only 'align' (with prefix caching on) keeps a state at each block boundary, and KV of its "
                "attention layers without its state would be wrong")
    speculative = getattr(vllm_config, "speculative_config", None)
    if any(getattr(spec, "num_speculative_blocks", 0) for spec in states) or speculative is not None:
        return "with speculative decoding vLLM moves its state layers' blocks between positions (MTP/EAGLE)"
    block_size = int(states[0].block_size)
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or getattr(
        getattr(vllm_config, "cache_config", None), "hash_block_size", None)
    if hash_block is not None and int(hash_block) < block_size:
        return (f"its prefix-cache hashes ({hash_block} tokens) are finer than its blocks ({block_size}): a state "
                "block may hold a state inside the block, which tiercache's whole-block keys cannot name")
    return None


def _elements(specs: list[Any], geometries: list[GroupGeometry]) -> tuple[str | None, int | None]:
    """The slots' element dtype and elements per quantization group (see ``SlotGeometry``), or (None, None: groups
    differ, not floats, or a state group, whose pages no lossy level may touch)."""
    if any(group.kind is GroupKind.STATE for group in geometries):
        return None, None
    dtypes = {str(spec.dtype).removeprefix("torch.") for spec in specs}
    sizes = [int(size) for spec in specs for size in (getattr(spec, "head_size", 0), getattr(spec, "head_size_v", 0))
             if isinstance(size, int) and size > 0]
    if len(dtypes) != 1 or not sizes:
        return None, None
    dtype, group = dtypes.pop(), math.gcd(*sizes)
    if dtype not in ELEMENT_DTYPES or any(g.page_bytes % (group * DTYPES[dtype]) for g in geometries):
        return None, None
    return dtype, group


def _page_bytes(spec: Any) -> int:
    """The bytes of a page a slot keeps: vLLM's unpadded page (a padded page's tail holds nothing)."""
    return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
