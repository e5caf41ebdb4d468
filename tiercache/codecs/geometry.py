"""A block's bytes seen as K and V per layer, or as groups of an engine's page elements: what a lossy level needs.

A level quantizes values, so it must know what each byte is. A ``KVLayout``
says it all: layers, KV heads, head size, dtype, block size and memory order,
so a block is ``[layers, 2, tokens, channels]``. An engine's pages
(``PageLayout``) say less: where the engine gives their element dtype and group
size (``element_dtype``, ``group_elements``: vLLM's head size, the innermost,
contiguous dimension of every attention layout), a page is a run of groups of
that many contiguous elements, which ``int8`` quantizes one scale a group
(``pages``). ``compact`` needs tokens x channels per layer: it reads pages whose
engine gave a ``token_map`` (``tiercache.blocks.token_map``: where each token's K
and V lie, a kernel's packing included) through that map, and refuses others
(``unreadable``). Pages without those fields, or a dtype that is not a float,
are refused (``UnsupportedPages``): a lossy level never touches bytes it does
not understand.

What a group is on vLLM's CPU build (0.32, ``cpu_attn.py``: LBHNC, a page per
head is ``[2 * block_size, head_size]`` elements, the block's K then its V):
V rows are one token's head, but the attention kernel packs K (the ``vec`` and
``vec16`` kernels store it transposed, ``[head_size, block_size]``; ``amx``
packs K and V in tiles), so a group of ``head_size`` elements there may hold
several tokens' values of a few channels. It is still one layer's, one head's K
or V, never across them (a head's K is a whole number of groups): a valid
quantization group, only another one than a token's head.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from tiercache.blocks.layout import DTYPES, KVLayout, MemoryOrder, PageLayout
from tiercache.codecs.levels import Level

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"})
"""KV dtypes a lossy level reads as numbers."""
COMPACT_NEEDS = ("the compact level needs tokens x channels per layer (a topology's KVLayout, or an engine's "
                 "pages with a token_map)")
"""Why ``compact`` refuses an engine's pages known only as groups of elements."""


class UnsupportedPages(ValueError):
    """Pages whose K/V structure a lossy level cannot read."""


@dataclass(frozen=True)
class KVGeometry:
    """K and V of one block: ``layers`` x 2 x ``tokens`` x ``channels`` (heads x head size) in ``dtype``; or, for
    an engine's ``pages``, ``block_shape[0]`` groups of ``block_shape[1]`` contiguous elements, and where a token
    map was given, its ``index`` (``layers`` 0: no map)."""

    layers: int
    tokens: int
    channels: int
    dtype: str
    block_shape: tuple[int, ...]
    layer_major: bool
    pages: bool = False
    """An engine's pages: groups (``int8`` reads them), and K/V only through ``index`` (``compact``)."""
    index: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """Pages with a token map: each value's element in the block, ``[layers, 2, tokens, channels]``."""

    @classmethod
    def of(cls, layout: KVLayout | PageLayout) -> KVGeometry:
        """The geometry of ``layout``'s blocks; ``UnsupportedPages`` when they are not values a level can read."""
        if isinstance(layout, PageLayout):
            return cls._of_pages(layout)
        if layout.dtype not in FLOAT_DTYPES:
            raise UnsupportedPages(f"a lossy codec reads float KV; this layout's dtype is {layout.dtype}")
        return cls(layout.num_layers, layout.block_size, layout.num_kv_heads * layout.head_dim, layout.dtype,
                   layout.block_shape, layout.memory is MemoryOrder.LAYER_MAJOR)

    @classmethod
    def _of_pages(cls, layout: PageLayout) -> KVGeometry:
        if layout.element_dtype is None or layout.group_elements is None:
            raise UnsupportedPages(
                "a lossy codec needs the values of a block; these are an engine's opaque pages whose element "
                "dtype and group size (layout element_dtype, group_elements) the engine did not give"
            )
        if layout.element_dtype not in FLOAT_DTYPES:
            raise UnsupportedPages(f"a lossy codec reads float KV; these pages hold {layout.element_dtype}")
        groups = layout.block_bytes // DTYPES[layout.element_dtype] // layout.group_elements
        mapped = layout.token_map
        if mapped is None:
            return cls(0, layout.block_size, layout.group_elements, layout.element_dtype,
                       (groups, layout.group_elements), False, pages=True)
        return cls(mapped.layers, layout.block_size, mapped.channels, layout.element_dtype,
                   (groups, layout.group_elements), False, pages=True, index=mapped.index())

    def unreadable(self, level: Level) -> str | None:
        """Why ``level`` cannot code these blocks (None: it can)."""
        if self.pages and self.index is None and level is Level.COMPACT:
            return COMPACT_NEEDS + "; these are an engine's pages without one"
        return None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Values under one ``int8`` scale: one head of a token's K or V in a layer (the head size), or a page group
        (an engine's head size too): the innermost, contiguous dimension either way."""
        return self.block_shape[-1]

    @property
    def groups(self) -> int:
        """Runs of ``group_size`` values a block holds."""
        return math.prod(self.block_shape) // self.group_size

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    def _typed(self, block: memoryview) -> torch.Tensor:
        """``block`` as ``dtype`` in ``block_shape`` (the same memory)."""
        with warnings.catch_warnings():  # a read-only slot: torch warns that it could be written, it is not
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(block, dtype=torch.uint8).view(self.torch_dtype).view(self.block_shape)

    def values(self, block: memoryview) -> torch.Tensor:
        """The block's K/V as float32, ``[layers, 2, tokens, channels]`` (a copy; ``block`` is only read)."""
        if self.pages:
            if self.index is None:
                raise UnsupportedPages(COMPACT_NEEDS + "; these are an engine's pages, known only as groups")
            return self._typed(block).view(-1)[self.index].float()
        tensor = self._typed(block)
        if not self.layer_major:  # [2, layers, tokens, heads, dim]
            tensor = tensor.transpose(0, 1)
        return tensor.reshape(self.layers, 2, self.tokens, self.channels).float().contiguous()

    def vectors(self, block: memoryview) -> torch.Tensor:
        """The block's values as float32 ``[groups, group_size]``, K/V in ``values``' order (only read: float32
        pages are the block's own memory)."""
        if self.pages:
            return self._typed(block).float()
        return self.values(block).view(self.groups, self.group_size)

    def write(self, values: torch.Tensor, dest: memoryview) -> None:
        """Write ``values`` (``values``' or ``vectors``' shape) into ``dest`` in the block's own order and dtype."""
        target = torch.frombuffer(dest, dtype=torch.uint8).view(self.torch_dtype).view(self.block_shape)
        if self.pages and self.index is not None and values.dim() == len(self.index.shape):
            target.view(-1)[self.index.view(-1)] = values.reshape(-1).to(self.torch_dtype)
            return
        if self.pages:
            target.copy_(values.view(self.block_shape))
            return
        shaped = values.view(self.layers, 2, self.tokens, *self.block_shape[-2:])
        if not self.layer_major:
            shaped = shaped.transpose(0, 1)
        target.copy_(shaped)
