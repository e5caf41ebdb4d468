"""PagedKV: a model's per-layer K and V, read from and written to the tiercache pool through a block table.

An engine's attention keeps K/V in the pool tiercache manages (``mgr.gpu.tensors``),
addressed by a request's block table: position ``p`` lives in pool block
``table[p // block_size]`` at offset ``p % block_size``. This is the one piece of
glue every engine writes between its model and the pool, so it lives here, for
both memory orders of ``KVLayout`` and every layout dtype, with one indexed copy
per layer and call (no per-token Python loop).

Floating-point K/V are cast into a floating pool dtype (float16, bfloat16,
float32, float8); a ``uint8`` pool holds bytes the engine quantized itself and
takes only ``uint8`` input, never a silent float-to-integer cast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.blocks.layout import KVLayout

__all__ = ["KEY", "VALUE", "BlockTable", "PagedKV", "blocks_needed"]

KEY, VALUE = 0, 1
"""Index of K and V on the pool's ``2`` axis."""

BlockTable = Sequence[int] | torch.Tensor
"""A request's pool block ids in logical order (a list, or a long tensor already on the pool's device)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks a block table needs for ``num_tokens`` positions (a partial last block counts as one)."""
    if num_tokens < 0 or block_size <= 0:
        raise ValueError(f"blocks_needed: num_tokens must be >= 0 and block_size > 0, got {num_tokens}, {block_size}")
    return -(-num_tokens // block_size)


class PagedKV:
    """Per-layer K and V views ``[blocks, block_size, kv_heads, head_dim]`` over the pool tensors.

    The views alias the pool, so what ``write`` puts there is what tiercache stores,
    demotes and loads, in either memory order.
    """

    def __init__(self, layout: KVLayout, pool: Sequence[torch.Tensor]) -> None:
        """``pool``: the pool tensors of ``layout`` (e.g. ``mgr.gpu.tensors``), validated here."""
        layout.validate_pool(pool)
        self.layout = layout
        if layout.block_major:
            self.keys = [pool[0][:, KEY, layer] for layer in range(layout.num_layers)]
            self.values = [pool[0][:, VALUE, layer] for layer in range(layout.num_layers)]
        else:
            self.keys = [tensor[:, KEY] for tensor in pool]
            self.values = [tensor[:, VALUE] for tensor in pool]
        self.pool = list(pool)
        self.device = pool[0].device
        self.dtype = layout.torch_dtype

    def table(self, block_table: BlockTable) -> torch.Tensor:
        """``block_table`` as a long tensor on the pool's device (convert once, pass it to every call)."""
        return torch.as_tensor(block_table, dtype=torch.long, device=self.device)

    def write(self, layer: int, block_table: BlockTable, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[tokens, kv_heads, head_dim]`` of positions ``start...`` of one layer."""
        count = key.shape[0]
        if key.shape != value.shape or key.shape[1:] != self.keys[layer].shape[2:]:
            raise ValueError(
                f"PagedKV.write: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                f"[tokens, {self.layout.num_kv_heads}, {self.layout.head_dim}]"
            )
        table = self._covering(block_table, start + count)
        positions = torch.arange(start, start + count, device=self.device)
        size = self.layout.block_size
        blocks, offsets = table[positions // size], positions % size
        self.keys[layer][blocks, offsets] = self._cast_in(key)
        self.values[layer][blocks, offsets] = self._cast_in(value)

    def read(
        self, layer: int, block_table: BlockTable, length: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` of positions ``0 .. length-1`` of one layer (new tensors)."""
        table = self._covering(block_table, length)[: blocks_needed(length, self.layout.block_size)]
        key = self.keys[layer].index_select(0, table).flatten(0, 1)[:length]
        value = self.values[layer].index_select(0, table).flatten(0, 1)[:length]
        if dtype is not None:
            key, value = key.to(dtype), value.to(dtype)
        return key, value

    def read_blocks(
        self, block_ids: BlockTable, dtype: torch.dtype | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V ``[len(block_ids), block_size, kv_heads, head_dim]`` of whole pool blocks."""
        ids = self.table(block_ids)
        layers = []
        for keys, values in zip(self.keys, self.values, strict=True):
            key, value = keys.index_select(0, ids), values.index_select(0, ids)
            layers.append((key, value) if dtype is None else (key.to(dtype), value.to(dtype)))
        return layers

    def put_block(self, block: int, kv: torch.Tensor) -> None:
        """Write one whole block given in the layout's serialized order (``layout.block_shape``)."""
        kv = self._cast_in(kv.to(self.device))
        if self.layout.block_major:
            self.pool[0][block].copy_(kv)
            return
        for layer, tensor in enumerate(self.pool):
            tensor[block].copy_(kv[layer])

    def get_block(self, block: int) -> torch.Tensor:
        """One whole block, on the CPU, in the layout's serialized order."""
        if self.layout.block_major:
            return self.pool[0][block].cpu()
        return torch.stack([tensor[block].cpu() for tensor in self.pool])

    def _covering(self, block_table: BlockTable, end: int) -> torch.Tensor:
        table = self.table(block_table)
        if table.numel() * self.layout.block_size < end:
            raise ValueError(f"block table of {table.numel()} blocks does not cover {end} positions")
        return table

    def _cast_in(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == self.dtype:
            return tensor
        if not (tensor.dtype.is_floating_point and self.dtype.is_floating_point):
            raise TypeError(
                f"PagedKV.write: a {self.layout.dtype} pool takes {self.layout.dtype} K/V "
                f"(or floating point into a floating pool), got {tensor.dtype}"
            )
        return tensor.to(self.dtype)
