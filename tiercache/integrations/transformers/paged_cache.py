"""PagedCache: a ``transformers`` cache whose per-layer K/V live in a request's tiercache pool blocks.

A Hugging Face model calls ``cache.update(key, value, layer)`` once per layer and
forward pass; here that writes the new positions' K/V straight into the pool
blocks of the request's block table (through ``tiercache.blocks.paged.PagedKV``) and
returns the K/V of every position so far, gathered from the pool. A cache made
with ``cached_tokens=n`` starts as if positions ``0 .. n-1`` had been computed:
their K/V are whatever tiercache left in those blocks (a GPU hit or a load), so
the model prefills only the rest, positions continuing at ``n`` (``generate``
and the model's forward derive positions and the causal mask from
``get_seq_length``). One sequence per cache (batch size 1), as an engine serves
one request per block table.

The gather is an O(tokens) copy per layer and call: an eager fallback that lets
an unmodified ``transformers`` model run on the pool; an engine with a paged
attention kernel reads ``mgr.gpu.tensors`` through the block table instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicCache, DynamicLayer, LinearAttentionLayer

from tiercache.blocks.paged import BlockTable, PagedKV

__all__ = ["PagedCache", "PagedHybridLayer", "PagedLayer", "cache_argument"]


def cache_argument(model: Any, cache: Cache) -> dict[str, Cache]:
    """``cache`` under the keyword ``model`` takes it by: ``cache`` from transformers 5.24, ``past_key_values`` before.

    Spread it into ``model(...)`` or ``model.generate(...)``; the old name only warns in 5.24 and goes later.
    """
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {keyword: cache}


class PagedLayer(DynamicLayer):
    """One layer's view of a request's pool blocks; ``length`` positions hold K/V."""

    is_croppable = True

    def __init__(self, kv: PagedKV, table: torch.Tensor, index: int, length: int) -> None:
        super().__init__()
        self.kv, self.table, self.index, self.length = kv, table, index, length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool is the storage. Records dtype and device like ``DynamicLayer``."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv_heads, new, head_dim]`` K/V at the next positions; return all positions' K/V."""
        if key_states.shape[0] != 1:
            raise ValueError(f"PagedCache serves one sequence (batch size 1), got a batch of {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_keys, new_values = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        self.kv.write(self.index, self.table, self.length, new_keys, new_values)
        self.length += key_states.shape[-2]
        keys, values = self.kv.read(self.index, self.table, self.length, dtype=key_states.dtype)
        self.keys, self.values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions holding K/V (the cached prefix plus what the model wrote)."""
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) for the causal mask, as ``DynamicLayer`` reports them."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        """The positions the block table covers."""
        return self.table.numel() * self.kv.layout.block_size

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (their blocks are rewritten on the next update)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        """Forget every position (the blocks stay the request's)."""
        self.length = 0
        self.keys = self.values = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beams are not reordered here (one sequence per block table): see ``PagedCache.dense``."""
        raise NotImplementedError("PagedCache serves one sequence: beam search runs on PagedCache.dense()")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Several sequences per request are not kept here: see ``PagedCache.dense``."""
        raise NotImplementedError("PagedCache serves one sequence: num_return_sequences > 1 runs on PagedCache.dense()")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Several sequences per request are not supported."""
        raise NotImplementedError("PagedCache serves one sequence")


class PagedHybridLayer(LinearAttentionLayer, PagedLayer):
    """A layer with both a state and K/V (Falcon-H1's parallel attention and Mamba): the state here, K/V in the pool."""

    is_compileable = False

    def __init__(self, kv: PagedKV, table: torch.Tensor, index: int, length: int, number_of_states: int = 1) -> None:
        PagedLayer.__init__(self, kv, table, index, length)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """K/V come as two positional tensors (``update``), states as keywords, as transformers' hybrid layers do."""
        if args:
            PagedLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return PagedLayer.get_seq_length(self)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return PagedLayer.get_mask_sizes(self, query_length)

    def get_max_length(self) -> int:
        return PagedLayer.get_max_length(self)

    def crop(self, tokens_to_remove: int) -> None:
        """A state cannot be rolled back without its history: refused, as in ``PagedCache``'s state layers."""
        raise NotImplementedError("a layer with a state cannot be cropped in PagedCache")

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        PagedLayer.reset(self)


LayerKind = tuple[str, int]
"""A layer's cache for ``PagedCache``: ``("kv" | "state" | "both" | "none", number of states)``."""


class PagedCache(Cache):
    """A ``transformers`` ``Cache`` over the pool blocks of one request (pass it with ``cache_argument``).

    A hybrid model's cache (``kinds``) keeps its state layers here, as ``LinearAttentionLayer``, and its K/V
    layers in the pool, the ``i``-th K/V layer in the pool's layer ``i``.
    """

    def __init__(
        self, kv: PagedKV, block_table: BlockTable, cached_tokens: int = 0, kinds: list[LayerKind] | None = None
    ) -> None:
        """``block_table`` covers every position the request will reach; ``cached_tokens`` are already there."""
        table = kv.table(block_table)
        if not 0 <= cached_tokens <= table.numel() * kv.layout.block_size:
            raise ValueError(f"cached_tokens {cached_tokens} outside the {table.numel()}-block table")
        self.block_table = table
        if kinds is None:
            kinds = [("kv", 0)] * kv.layout.num_layers
        layers: list[Any] = []
        pool_layer = 0
        for kind, states in kinds:
            if kind == "state":
                layers.append(LinearAttentionLayer(number_of_states=states))
            elif kind == "none":
                layers.append(DummyLayer())
            else:
                paged = PagedLayer if kind == "kv" else PagedHybridLayer
                layers.append(paged(kv, table, pool_layer, cached_tokens, *([states] if kind == "both" else [])))
                pool_layer += 1
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions the cache holds (a hybrid's state layers count the same, as an int from its K/V layers)."""
        paged = [layer for layer in self.layers if isinstance(layer, PagedLayer)]
        return paged[0].get_seq_length() if paged else super().get_seq_length(layer_idx)

    def dense(self, copies: int, dtype: torch.dtype) -> DynamicCache:
        """The K/V so far as a ``DynamicCache`` of ``copies`` identical rows, every position kept as here.

        Beam search and several samples per prompt decode there: transformers
        reorders and grows its rows, while the pool blocks keep the one prompt.
        """
        cache = DynamicCache()
        for layer in self.layers:
            if layer.length:
                keys, values = layer.kv.read(layer.index, layer.table, layer.length, dtype=dtype)
                rows = [part.transpose(0, 1).unsqueeze(0).expand(copies, -1, -1, -1).contiguous()
                        for part in (keys, values)]
                cache.update(rows[0], rows[1], layer.index)
        return cache
