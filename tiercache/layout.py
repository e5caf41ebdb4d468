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
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.validate import FieldError

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


MAX_LAYOUT_DIM = 1 << 20
"""Largest layer count, head count, head size or block size accepted (larger is a typo)."""
MAX_BLOCK_BYTES = 1 << 32
"""Largest block: the codec and every tier size buffers per block; 4 GiB is far past any model's."""


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

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def layer_piece_shape(self) -> tuple[int, ...]:
        """One layer's K and V of one block."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

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

    def fingerprint(self) -> str:
        """A stable short id of everything that decides a block's bytes."""
        text = (
            f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}/{self.block_size}/{self.memory.value}"
        )
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def pool_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """Shapes of the pool tensors for ``num_blocks`` blocks."""
        b, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.block_major:
            return [(num_blocks, 2, self.num_layers, b, h, d)]
        return [(num_blocks, 2, b, h, d)] * self.num_layers

    def allocate_pool(self, num_blocks: int, device: str | torch.device) -> list[torch.Tensor]:
        """Zeroed pool tensors on ``device``."""
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
