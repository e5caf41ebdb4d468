"""KVLayout: the shape of one block of KV across all layers, and how the pool lays it out.

Two memory orders are supported, matching what engines keep:

* ``BLOCK_MAJOR``: one tensor ``[num_blocks, 2, layers, block_size, kv_heads, head_dim]``;
  a block is one contiguous piece.
* ``LAYER_MAJOR``: one tensor per layer, ``[num_blocks, 2, block_size, kv_heads, head_dim]``
  (vLLM/SGLang style); a block is ``layers`` pieces, one per layer tensor.

A block's serialized form (a CPU slot, a remote value) is the block's bytes in the
pool's order: ``[2, layers, B, H, D]`` for block-major, ``[layers, 2, B, H, D]`` for
layer-major. The memory order is part of the fingerprint, so the two never mix.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.blocks.namespaces import PageFormat
from tiercache.blocks.token_map import PageTokenMap
from tiercache.common.fields import FieldError

if TYPE_CHECKING:
    import torch

DTYPES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
"""The KV dtypes a layout may name (torch's names), with their bytes per element. torch itself is imported
only when a tensor is made or checked, so a topology is validated without it."""


MAX_LAYOUT_DIM = 1 << 20
"""Largest layer count, head count, head size or block size accepted (larger is a typo)."""
MAX_BLOCK_BYTES = 1 << 32
"""Largest block: the codec and every tier size buffers per block; 4 GiB is far past any model's."""
KV_FORMAT = "tiercache-kv"
"""The page format of a ``KVLayout``'s blocks (K/V per layer, in the pool's order)."""
PAGES_FORMAT = "tiercache-pages"
"""The page format of a ``PageLayout`` a topology declares without an engine's description."""


class UnsupportedModelError(ValueError):
    """A model whose KV cache is not plain per-layer K/V, which tiercache must not cache."""


HF_STATE_SPACE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "linear_conv_kernel_dim", "layers_block_type")
"""Config fields that only state-space (Mamba) and hybrid models have."""
HF_PLAIN_KV_LAYERS = frozenset({"full_attention", "sliding_attention"})
"""``layer_types`` entries whose cache is plain K/V: a sliding layer attends to a window of it, which the
model's attention mask applies, so a pool that keeps every position serves it like a full layer."""
HF_STATE_LAYERS = frozenset({"linear_attention", "conv", "mamba", "mlp", "moe"})
"""``layer_types`` entries with no K/V of their own (a state, or no cache at all): allowed ``with_state``."""
HF_KV_AND_STATE_LAYERS = frozenset({"hybrid", "hybrid_sliding"})
"""``layer_types`` entries with K/V and a state side by side (Falcon-H1): one pool layer each ``with_state``."""


class MemoryOrder(enum.Enum):
    BLOCK_MAJOR = "block_major"
    LAYER_MAJOR = "layer_major"


@dataclass(frozen=True)
class KVLayout:
    """Fixes the bytes of a block; every tier sizes its slots from it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = 16
    memory: MemoryOrder = MemoryOrder.BLOCK_MAJOR

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_LAYOUT_DIM:
                raise FieldError(name, f"a positive integer up to {MAX_LAYOUT_DIM}", value)
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"one of {sorted(DTYPES)}", self.dtype)
        if not isinstance(self.memory, MemoryOrder):
            object.__setattr__(self, "memory", MemoryOrder(self.memory))
        if self.bytes_per_block > MAX_BLOCK_BYTES:
            raise FieldError(
                "num_layers",
                f"a layout of at most {MAX_BLOCK_BYTES} bytes per block (this one has {self.bytes_per_block})",
                self.num_layers,
            )

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
        memory: MemoryOrder | str = MemoryOrder.BLOCK_MAJOR,
        with_state: bool = False,
    ) -> KVLayout:
        """The layout of a Hugging Face ``transformers`` model's KV cache, read from its config.

        Layers, KV heads and head dim come from the (text) config, ``head_dim`` when
        the config sets it explicitly, else ``hidden_size // num_attention_heads``.
        ``dtype`` defaults to the config's dtype, else float32 (what a model built
        from a config computes in). Full and sliding-window attention layers keep
        plain K/V (the mask applies a window). A model whose cache is not plain
        per-layer K/V (chunked attention, state-space or linear-attention layers,
        latent or shared KV, encoder-decoder) raises ``UnsupportedModelError``:
        caching it as plain K/V would serve wrong KV. ``with_state``: a hybrid's layout,
        its K/V layers only (``num_layers`` counts them), for a caller that saves the
        state layers' state beside it (``CachedModel``). Duck-typed: transformers is
        not imported.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        reasons = _unsupported_cache_reasons(text, with_state)
        if reasons:
            raise UnsupportedModelError(
                f"{getattr(text, 'model_type', type(text).__name__)}: tiercache caches plain per-layer K/V only; "
                f"this model has {'; '.join(reasons)}: not supported"
            )
        heads = _hf_field(text, "num_attention_heads")
        head_dim = getattr(text, "head_dim", None) or _hf_field(text, "hidden_size") // heads
        if dtype is None:
            configured = text.dtype if hasattr(text, "dtype") else getattr(text, "torch_dtype", None)
            dtype = str(configured).removeprefix("torch.") if configured is not None else "float32"
        elif not isinstance(dtype, str):  # a torch.dtype
            dtype = str(dtype).removeprefix("torch.")
        layer_types = getattr(text, "layer_types", None) if with_state else None
        return cls(
            num_layers=(sum(kind not in HF_STATE_LAYERS for kind in layer_types) if layer_types
                        else _hf_field(text, "num_hidden_layers")),
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            dtype=dtype,
            block_size=block_size,
            memory=MemoryOrder(memory),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def layer_piece_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_shape(self) -> tuple[int, ...]:
        """A block's serialized shape (see the module docstring)."""
        b, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.memory is MemoryOrder.BLOCK_MAJOR:
            return (2, self.num_layers, b, h, d)
        return (self.num_layers, 2, b, h, d)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.layer_piece_bytes

    @property
    def block_major(self) -> bool:
        return self.memory is MemoryOrder.BLOCK_MAJOR

    def page_format(self) -> PageFormat:
        """Everything beyond the model that decides a block's bytes (the namespace's page format)."""
        return PageFormat(KV_FORMAT, {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "dtype": self.dtype, "block_size": self.block_size, "memory": self.memory.value,
        })

    def pool_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """Shapes of the pool tensors for ``num_blocks`` blocks."""
        b, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.block_major:
            return [(num_blocks, 2, self.num_layers, b, h, d)]
        return [(num_blocks, 2, b, h, d)] * self.num_layers

    def allocate_pool(self, num_blocks: int, device: str | torch.device) -> list[torch.Tensor]:
        """Zeroed pool tensors on ``device``."""
        import torch

        return [torch.zeros(shape, dtype=self.torch_dtype, device=device) for shape in self.pool_shapes(num_blocks)]

    def validate_pool(self, tensors: Sequence[torch.Tensor]) -> int:
        """Check tensors handed in by an engine; return their number of blocks."""
        if not tensors:
            raise ValueError("pool tensors: expected at least one tensor")
        num_blocks = tensors[0].shape[0]
        expected = self.pool_shapes(num_blocks)
        if len(tensors) != len(expected):
            raise ValueError(
                f"pool tensors: expected {len(expected)} tensor(s) for {self.memory.value}, got {len(tensors)}"
            )
        device = tensors[0].device
        for index, (tensor, shape) in enumerate(zip(tensors, expected, strict=True)):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"pool tensor {index}: expected shape {shape}, got {tuple(tensor.shape)}")
            if tensor.dtype != self.torch_dtype:
                raise ValueError(f"pool tensor {index}: expected dtype {self.dtype}, got {tensor.dtype}")
            if not tensor.is_contiguous():
                raise ValueError(f"pool tensor {index}: must be contiguous")
            if tensor.device != device:
                raise ValueError(f"pool tensor {index}: on {tensor.device}, others on {device}")
        return num_blocks


def _hf_field(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"KVLayout.from_hf_config: config.{name} must be a positive integer, got {value!r}")
    return value


def _unsupported_cache_reasons(config: Any, with_state: bool = False) -> list[str]:
    """Why a transformers config's cache is not plain per-layer K/V (empty when it is); ``with_state``: beside
    state layers."""
    reasons = []
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("an encoder-decoder cache")
    allowed = HF_PLAIN_KV_LAYERS | (HF_STATE_LAYERS | HF_KV_AND_STATE_LAYERS if with_state else frozenset())
    layer_types = set(getattr(config, "layer_types", None) or ()) - allowed
    if layer_types:
        reasons.append(f"layers of type {', '.join(sorted(layer_types))}")
    if getattr(config, "attention_chunk_size", None):
        reasons.append("chunked attention")
    state_fields = [name for name in HF_STATE_SPACE_FIELDS if getattr(config, name, None) is not None]
    kinds = getattr(config, "layer_types", None) or ()
    if state_fields and with_state and not kinds:
        reasons.append("state-space layers and no layer_types saying which layers they are")
    elif with_state and kinds and all(kind in HF_STATE_LAYERS for kind in kinds):
        reasons.append("state-space layers only, and no attention layers whose K/V a state would sit beside")
    elif state_fields and not with_state:
        reasons.append(f"state-space layers ({', '.join(state_fields)})")
    if getattr(config, "kv_lora_rank", None):
        reasons.append("latent (compressed) KV")
    if getattr(config, "num_kv_shared_layers", None) or getattr(config, "kv_sharing_modes", None):
        reasons.append("KV shared between layers")
    return reasons


@dataclass(frozen=True)
class PageLayout:
    """A block as an engine's opaque pages: ``block_bytes`` per block of ``block_size`` tokens, moved whole and never
    read as K/V (the engine knows their order). Only below an engine's own pool (``LowerTiers``): a topology says
    ``layout: {block_bytes: N, block_size: B}``; an engine adds its ``engine_format`` (what fixes those bytes).

    An engine that knows its pages' element dtype and how many contiguous elements belong together (its head size,
    the innermost dimension of every attention layout) says so in ``element_dtype`` and ``group_elements``; the
    ``int8`` level then quantizes a page as groups of that many elements (``tiercache.codecs.geometry``), and both
    are part of the page format, so fleets that group differently never share values. An engine that knows where
    each token's K and V lie in its pages gives a ``token_map`` too, and the ``compact`` level reads them."""

    block_bytes: int
    block_size: int = 16
    engine_format: PageFormat | None = None
    """The engine's description of its pages (None: only their size and block size are known)."""
    element_dtype: str | None = None
    """The float dtype of the pages' elements (torch's name; None: unknown, the pages are bytes to every level)."""
    group_elements: int | None = None
    """Contiguous elements that belong together (one head of one token, or one run of a kernel's packed head): the
    ``int8`` level keeps one scale per group. Given with ``element_dtype``; divides a block's elements."""
    token_map: PageTokenMap | None = None
    """Where each token's K and V of each channel lie in a block (None: unknown; ``compact`` then declines)."""

    dtype = "uint8"
    """Pages are bytes: every tier sizes and copies them as such."""

    def __post_init__(self) -> None:
        for name, highest in (("block_bytes", MAX_BLOCK_BYTES), ("block_size", MAX_LAYOUT_DIM)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= highest:
                raise FieldError(name, f"a positive integer up to {highest}", value)
        if (self.element_dtype is None) != (self.group_elements is None):
            raise FieldError("group_elements", "given together with element_dtype, or neither",
                             self.group_elements)
        if self.element_dtype is not None:
            if self.element_dtype not in DTYPES or self.element_dtype == "uint8":
                raise FieldError("element_dtype", f"one of {sorted(set(DTYPES) - {'uint8'})}", self.element_dtype)
            group = self.group_elements
            if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or self.block_bytes % (
                group * DTYPES[self.element_dtype]
            ):
                raise FieldError("group_elements", f"a positive integer whose groups of {self.element_dtype} "
                                 f"divide a block of {self.block_bytes} bytes", group)
        mapped = self.token_map
        if mapped is not None and (self.element_dtype is None or mapped.tokens != self.block_size
                                   or mapped.elements * DTYPES[self.element_dtype] != self.block_bytes):
            raise FieldError("token_map", f"a map of {self.block_size} tokens whose elements of the element dtype "
                             f"fill a block of {self.block_bytes} bytes", mapped.source)

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.block_bytes,)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return torch.uint8

    def page_format(self) -> PageFormat:
        """The engine's format, or (declared in a topology) the pages' size and block size; with the element dtype
        and group size where they are known."""
        base = self.engine_format or PageFormat(PAGES_FORMAT, {"block_bytes": self.block_bytes,
                                                               "block_size": self.block_size})
        if self.element_dtype is None:
            return base
        return PageFormat(base.engine, {**base.fields, "element_dtype": self.element_dtype,
                                        "group_elements": self.group_elements})
