"""vLLM's KV tensors and the CPU slots as pages in one canonical order, whatever vLLM's physical KV layout.

vLLM (0.32, 0.33) hands a worker one view per layer of the logical shape
``[blocks, heads, tokens, content]`` (RFC #42082), laid out in memory by one of
six stride permutations (``vllm/v1/kv_cache_layout.py``: LBHNC, LBNHC, LHBNC,
BLHNC, BLNHC, BHLNC) and possibly padded; MLA has one latent head. The page
map here is read from each view's shape and strides, nothing else: a block's
page is ``view[block]`` as bytes (``[heads, tokens, content bytes]``), and a
slot keeps it contiguous in that logical order. So a page may be one run of
memory (LBHNC, BLHNC), one per (head, token) cell (token-major LBNHC, BLNHC:
flash-attention's) or one per head (LHBNC, BHLNC); a page saved under one
layout loads into another byte for byte (docs/engines.md, "KV layouts, GPU copies and CUDA graphs").
A view the map cannot read (not a tensor, blocks not on its first dim, content
not contiguous, a page of another size than vLLM's spec) is refused with the
layer, backend, shape and strides, before anything is copied.

Why not vLLM 0.33's own ``CanonicalKVCaches`` / ``CanonicalPageMapping``
(``vllm/v1/kv_offload/base.py``): its offloading worker builds them for itself
from the same tensors, and no connector is handed them; 0.32 (the CPU build the
served tests run) has neither; and their canonical page is the physical page's
bytes (runs that undo tensor parallelism, not the layout's permutation), so a
page saved under LBNHC would not load into LBHNC. The logical order here is what
lets instances on different backends share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry, UnsupportedLayoutError


def page_view(name: str, tensor: object, page_bytes: int, num_blocks: int | None = None,
              backend: str = "unknown") -> torch.Tensor:
    """``tensor`` as uint8 ``[num_blocks, *page]`` (the page's dims in vLLM's logical order, the last in bytes), the
    same memory; ``UnsupportedLayoutError`` naming the layer, backend, shape and strides where it cannot be.

    A cache in kernel blocks (a backend splitting vLLM's blocks: ``num_blocks`` times k rows) is grouped back:
    ``[blocks, heads, k, tokens, content]``, whose order is the block's ``[heads, tokens, content]`` all the same."""
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedLayoutError(f"layer {name} ({backend}): vLLM registered a {type(tensor).__name__}, not one "
                                     "KV tensor per layer")
    where = f"layer {name} ({backend}, shape {tuple(tensor.shape)}, strides {tensor.stride()}, {tensor.dtype})"
    if tensor.dim() < 2 or tensor.stride(-1) != 1:
        raise UnsupportedLayoutError(f"{where}: a page's innermost dimension is not contiguous")
    raw = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
    if num_blocks is not None and raw.shape[0] != num_blocks:
        if raw.dim() != 4 or raw.shape[0] % num_blocks:
            raise UnsupportedLayoutError(f"{where}: {raw.shape[0]} rows are not kernel blocks of {num_blocks} blocks")
        raw = raw.unflatten(0, (num_blocks, -1)).permute(0, 2, 1, 3, 4)
    if raw[0].numel() != page_bytes:
        raise UnsupportedLayoutError(f"{where}: a block's page has {raw[0].numel()} bytes, vLLM's KV cache spec says "
                                     f"{page_bytes}")
    return raw


def runs_per_page(view: torch.Tensor) -> int:
    """The contiguous runs of memory one page of ``view`` is read as, in the slot's order (1: copied whole)."""
    page, run = view[0], 1
    for size, stride in reversed(list(zip(page.shape, page.stride(), strict=True))):
        if size == 1:
            continue
        if stride != run:
            break
        run *= size
    return math.prod(page.shape) // run


def slot_pages(slots: torch.Tensor, offset: int, page_shape: tuple[int, ...]) -> torch.Tensor:
    """``[num_slots, *page_shape]`` view of each slot's page at ``offset`` (contiguous within a slot)."""
    strides = [1] * len(page_shape)
    for dim in range(len(page_shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * page_shape[dim + 1]
    return slots.as_strided((slots.shape[0], *page_shape), (slots.stride(0), *strides),
                            slots.storage_offset() + offset)


@dataclass(frozen=True)
class LayerPages:
    """One layer as pages: vLLM's blocks and this rank's page in every slot, both ``[n, *page]`` uint8."""

    name: str
    group: int
    blocks: torch.Tensor
    slots: torch.Tensor
    runs: int
    """Contiguous runs per page on vLLM's side."""


def state_views(kv_caches: Mapping[str, object], kv_cache_config: object, geometry: SlotGeometry,
                num_blocks: int) -> dict[str, object]:
    """``kv_caches`` with each state layer as uint8 ``[num_blocks, page]`` over vLLM's memory.

    vLLM 0.33 registers a state layer (Mamba, linear attention) as the raw backing allocation itself (its specs
    have no per-layer view); ``kv_cache_config.kv_cache_tensors`` places its page of block ``b`` at
    ``offset + layer index * layer_stride + b * block_stride``. A list of state tensors (one per state, blocks on
    the first dim) is viewed from its first tensor's block 0 with its block stride. A layer already shaped by
    blocks is left as it is."""
    placements = {name: (tensor.offset + index * tensor.layer_stride, tensor.block_stride)
                  for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ()
                  for index, name in enumerate(tensor.layers)}
    views = dict(kv_caches)
    for spec in geometry.groups:
        if spec.kind is not GroupKind.STATE:
            continue
        for name in spec.layer_names:
            value = kv_caches.get(name)
            if isinstance(value, list | tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
                first = value[0]
                start, stride = first.storage_offset() * first.element_size(), first.stride(0) * first.element_size()
                views[name] = _rows(first, start, stride, num_blocks, spec.page_bytes)
            elif isinstance(value, torch.Tensor) and value.dim() == 1 and name in placements:
                start, stride = placements[name]
                views[name] = _rows(value, value.storage_offset() * value.element_size() + start, stride, num_blocks,
                                    spec.page_bytes)
    return views


def _rows(tensor: torch.Tensor, start: int, stride: int, num_blocks: int, page_bytes: int) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` over ``tensor``'s storage from byte ``start``, a row every ``stride``."""
    storage = tensor.untyped_storage()
    if start + (num_blocks - 1) * stride + page_bytes > storage.nbytes() or page_bytes > stride:
        raise UnsupportedLayoutError(f"a state layer's pages ({num_blocks} x {page_bytes} bytes every {stride}, from "
                                     f"byte {start}) do not fit its {storage.nbytes()}-byte allocation")
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    return raw.as_strided((num_blocks, page_bytes), (stride, 1), start)


def page_views(kv_caches: Mapping[str, object], geometry: SlotGeometry, num_blocks: int | None = None,
               backends: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every layer the geometry names as ``page_view``s of vLLM's ``num_blocks`` blocks (``UnsupportedLayoutError``
    for the first it cannot map)."""
    missing = [name for name in geometry.layer_names if name not in kv_caches]
    if missing:
        raise UnsupportedLayoutError(f"vLLM registered no KV tensor for layers {missing}")
    backends = backends or {}
    return {name: page_view(name, kv_caches[name], spec.page_bytes, num_blocks, backends.get(name, "unknown"))
            for spec in geometry.groups for name in spec.layer_names}


class KVPages:
    """A worker's KV tensors (``page_views``) and the region's slots as pages, in the geometry's layer order (group
    by group)."""

    def __init__(self, views: Mapping[str, torch.Tensor], geometry: SlotGeometry, rank: int,
                 slots: torch.Tensor) -> None:
        self.layers: list[LayerPages] = []
        for group, spec in enumerate(geometry.groups):
            for index, name in enumerate(spec.layer_names):
                blocks = views[name]
                page_slots = slot_pages(slots, geometry.offset(rank, group, index), tuple(blocks.shape[1:]))
                self.layers.append(LayerPages(name, group, blocks, page_slots, runs_per_page(blocks)))
        self.index = {layer.name: position for position, layer in enumerate(self.layers)}
        self.device = self.layers[0].blocks.device if self.layers else torch.device("cpu")

    def describe(self) -> str:
        """The page map in one line, for the log: per distinct (shape, strides), its layers and runs per page."""
        seen: dict[tuple[object, ...], list[str]] = {}
        for layer in self.layers:
            key = (tuple(layer.blocks.shape[1:]), layer.blocks.stride(), layer.runs)
            seen.setdefault(key, []).append(layer.name)
        return "; ".join(f"{len(names)} layers page {shape} bytes strides {strides}: {runs} runs per page"
                         for (shape, strides, runs), names in seen.items())
