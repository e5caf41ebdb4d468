"""vLLM's KV tensors as pages: per layer, one byte row per block, copied to and from the shared CPU slots.

vLLM hands a worker one tensor per layer (with its hybrid allocator, one layer of
each KV-cache group shares a tensor: block ids are unique across groups). What the connector needs of it is that
each block's page of a layer is one contiguous run of bytes (true of the CPU
backend's layout and of every layout whose block dimension is outside a page):
the page is then copied whole, its interior never read. A layout whose page is
split across the tensor (heads outside blocks, say) is refused with the layer
and strides, before anything is copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tiercache.integrations.vllm.connector.identity import SlotGeometry, UnsupportedLayoutError


def page_rows(name: str, tensor: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``tensor`` as a ``[num_blocks, page_bytes]`` uint8 view of the same memory (blocks on its first dim)."""
    if tensor.dim() < 2 or not tensor[0].is_contiguous():
        raise UnsupportedLayoutError(
            f"layer {name}: a block's page is not contiguous (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}); tiercache's connector copies whole pages"
        )
    item = tensor.element_size()
    if tensor[0].numel() * item != page_bytes:
        raise UnsupportedLayoutError(
            f"layer {name}: a block's page has {tensor[0].numel() * item} bytes, vLLM's KV cache spec says {page_bytes}"
        )
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    return raw.as_strided((tensor.shape[0], page_bytes), (tensor.stride(0) * item, 1), raw.storage_offset())


class KVPages:
    """A worker's KV tensors as page rows, in the geometry's layer order (group by group)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], geometry: SlotGeometry) -> None:
        missing = [name for name in geometry.layer_names if name not in kv_caches]
        if missing:
            raise UnsupportedLayoutError(f"vLLM registered no KV tensor for layers {missing}")
        self.rows = [
            page_rows(name, kv_caches[name], group.page_bytes)
            for group in geometry.groups
            for name in group.layer_names
        ]
        self.index = {name: layer for layer, name in enumerate(geometry.layer_names)}
        self.device = self.rows[0].device

    def load(self, layer: int, runs: Sequence[tuple[int, int, int]], region_rows: torch.Tensor) -> None:
        """Copy this rank's pages of ``layer`` from slots into blocks: ``runs`` of (first slot, first block,
        count), each one ``copy_`` (a gather through ``index_select`` is several times slower here)."""
        rows = self.rows[layer]
        for slot, block, count in runs:
            rows[block : block + count].copy_(region_rows[slot : slot + count])

    def save(self, layer: int, runs: Sequence[tuple[int, int, int]], region_rows: torch.Tensor) -> None:
        """Copy this rank's pages of ``layer`` from blocks into slots: ``runs`` of (first block, first slot,
        count)."""
        rows = self.rows[layer]
        for block, slot, count in runs:
            region_rows[slot : slot + count].copy_(rows[block : block + count])
