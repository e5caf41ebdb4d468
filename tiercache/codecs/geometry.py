"""A block's bytes seen as K and V per layer: what a lossy level needs to know, or a refusal.

A level quantizes values, so it must know what each byte is: the layout's
layers, KV heads, head size, dtype, block size and memory order
(``KVLayout``). An engine's opaque pages (``PageLayout``), or a dtype that is
not a float, are refused (``UnsupportedPages``): a lossy level never touches
bytes it does not understand.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tiercache.blocks.layout import KVLayout, MemoryOrder, PageLayout

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"})
"""KV dtypes a lossy level reads as numbers."""


class UnsupportedPages(ValueError):
    """Pages whose K/V structure a lossy level cannot read."""


@dataclass(frozen=True)
class KVGeometry:
    """K and V of one block: ``layers`` x 2 x ``tokens`` x ``channels`` (heads x head size) in ``dtype``."""

    layers: int
    tokens: int
    channels: int
    dtype: str
    block_shape: tuple[int, ...]
    layer_major: bool

    @classmethod
    def of(cls, layout: KVLayout | PageLayout) -> KVGeometry:
        """The geometry of ``layout``'s blocks; ``UnsupportedPages`` when they are not K/V a level can read."""
        if not isinstance(layout, KVLayout):
            raise UnsupportedPages(
                "a lossy codec needs the K/V structure of a block (a layout of layers, heads, head size and dtype); "
                "these are an engine's opaque pages"
            )
        if layout.dtype not in FLOAT_DTYPES:
            raise UnsupportedPages(f"a lossy codec reads float KV; this layout's dtype is {layout.dtype}")
        return cls(layout.num_layers, layout.block_size, layout.num_kv_heads * layout.head_dim, layout.dtype,
                   layout.block_shape, layout.memory is MemoryOrder.LAYER_MAJOR)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.tokens * self.channels * self.itemsize

    def values(self, block: memoryview) -> torch.Tensor:
        """The block's K/V as float32, ``[layers, 2, tokens, channels]`` (a copy; ``block`` is only read)."""
        with warnings.catch_warnings():  # a read-only slot: torch warns that it could be written, it is not
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(block, dtype=torch.uint8).view(self.torch_dtype).view(self.block_shape)
        if not self.layer_major:  # [2, layers, tokens, heads, dim]
            tensor = tensor.transpose(0, 1)
        return tensor.reshape(self.layers, 2, self.tokens, self.channels).float().contiguous()

    def write(self, values: torch.Tensor, dest: memoryview) -> None:
        """Write ``[layers, 2, tokens, channels]`` values into ``dest`` in the block's own order and dtype."""
        target = torch.frombuffer(dest, dtype=torch.uint8).view(self.torch_dtype).view(self.block_shape)
        shaped = values.view(self.layers, 2, self.tokens, *self.block_shape[-2:])
        if not self.layer_major:
            shaped = shaped.transpose(0, 1)
        target.copy_(shaped)
