"""SGLang's host KV pool as byte views: the pieces of each page, without copying them.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) describe a page to zero-copy
backends with ``get_page_buffer_meta(indices)``: the address and size of each contiguous piece a page is
made of, in a fixed order (K and V of an MHA page in the page-first layouts, K and V per layer in
``layer_first``, one piece per MLA page, one per layer for MLA in ``layer_first``). tiercache stores each
piece as one remote block, so a read lands straight in the pool and a write is sent straight from it:
``views`` slices one byte view over the pool's buffer, and checks every piece lies inside it.

The older calls (``batch_get``/``batch_set``) hand whole flat pages in the layout's element order
(``get_data_page(i, flat=True)``, ``set_from_flat_data_page``). ``flat_views`` cuts such a page into the
same pieces, so both kinds of call read and write the same blocks; which part of a flat page is which
piece is read once from the pool's own page view (``piece_order``).
"""

from __future__ import annotations

from typing import Any

import torch

GEOMETRY_ATTRIBUTES = (
    "layer_num", "head_num", "head_dim", "v_head_dim", "kv_cache_dim", "kv_lora_rank", "qk_rope_head_dim"
)
"""Host-pool attributes that fix a page's bytes (whichever the pool has); they go into the namespace."""


class UnsupportedPool(TypeError):
    """A host pool whose pages are not pieces of one CPU buffer (e.g. split K/V buffers, a DCP pool)."""


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (any dtype), sharing its memory."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class HostPages:
    """Byte views of a registered host pool's pages, piece by piece (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise UnsupportedPool(f"{type(pool).__name__}: tiercache needs the pages in one contiguous CPU kv_buffer")
        if getattr(pool, "dcp_size", 1) != 1:
            raise UnsupportedPool(f"{type(pool).__name__}: decode context parallel pools are not supported")
        self.pool = pool
        self.page_size: int = pool.page_size
        self.layout: str = pool.layout
        self.dtype = buffer.dtype
        self._base = buffer.data_ptr()
        self._bytes = byte_view(buffer)
        try:
            pointers, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        except (ValueError, AssertionError, NotImplementedError, AttributeError) as error:
            raise UnsupportedPool(
                f"{type(pool).__name__} ({self.layout}): SGLang gives no zero-copy page metadata for it ({error}); "
                "use --hicache-mem-layout page_first, page_first_direct, page_head or layer_first"
            ) from None
        if not pointers or len(set(sizes)) != 1:
            raise UnsupportedPool(f"{type(pool).__name__} ({self.layout}): pages are not pieces of one size")
        self.pieces = len(pointers)
        """Remote blocks per page."""
        self.piece_bytes: int = sizes[0]
        self.geometry = {name: getattr(pool, name) for name in GEOMETRY_ATTRIBUTES if hasattr(pool, name)}
        self.piece_order = _piece_order(pool, pointers, self.piece_bytes)
        """``piece_order[j]``: the piece that the j-th equal part of a flat page is."""

    def views(self, host_indices: torch.Tensor, pages: int) -> list[memoryview] | None:
        """The pieces of ``pages`` pages at ``host_indices`` (page after page), or None when they do not fit."""
        if host_indices.numel() != pages * self.page_size:
            return None
        pointers, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(pointers) != pages * self.pieces or any(size != self.piece_bytes for size in sizes):
            return None
        views = []
        end = len(self._bytes)
        for pointer in pointers:
            offset = pointer - self._base
            if offset < 0 or offset + self.piece_bytes > end:
                return None
            views.append(self._bytes[offset : offset + self.piece_bytes])
        return views

    def flat_views(self, page: Any) -> list[memoryview] | None:
        """The pieces of one flat page tensor (in piece order), or None when it is not such a page."""
        if (
            not isinstance(page, torch.Tensor)
            or page.device.type != "cpu"
            or not page.is_contiguous()
            or page.numel() * page.element_size() != self.pieces * self.piece_bytes
        ):
            return None
        data, size = byte_view(page), self.piece_bytes
        views: list[memoryview] = [data] * self.pieces
        for part, piece in enumerate(self.piece_order):
            views[piece] = data[part * size : (part + 1) * size]
        return views


def _piece_order(pool: Any, pointers: list[int], piece_bytes: int) -> list[int]:
    """Which piece each equal part of page 0's flat form is, from the pool's own (unflattened) page view."""
    page = pool.get_data_page(0, flat=False)
    item = page.element_size()
    if piece_bytes % item or page.numel() * item != len(pointers) * piece_bytes:
        raise UnsupportedPool(f"{type(pool).__name__} ({pool.layout}): a page's view and its pieces disagree")
    try:
        parts = page.view(len(pointers), piece_bytes // item)  # a view only where each part is one run of memory
    except RuntimeError:
        raise UnsupportedPool(f"{type(pool).__name__} ({pool.layout}): a flat page's parts are not pieces") from None
    starts = [parts[j].data_ptr() for j in range(len(pointers))]
    if parts.stride(1) != 1 or sorted(starts) != sorted(pointers):
        raise UnsupportedPool(f"{type(pool).__name__} ({pool.layout}): a flat page's parts are not its pieces")
    return [pointers.index(start) for start in starts]
