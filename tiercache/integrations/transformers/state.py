"""The state of a hybrid model's state layers (Mamba, gated delta net, short convolutions) as tiercache pages.

A state layer keeps one running state per sequence, not K/V per token, so a
prefix ending at block ``n`` is reusable only with every state layer's state
after exactly ``n`` blocks (docs/architecture.md, "State beside the KV"). That
state is kept as ``StateFormat.pages`` extra pool pages, stored as a chain that
continues the prefix's own chain with marker tokens (``state_tokens``): the
chain's keys then name "the state at the end of this prefix", and every tier,
pin, eviction and integrity rule of KV holds for it unchanged. A lookup of that
chain is whole only while the prefix's KV and its state are both held.

The pages are raw bytes: a header (magic, the prefix length, the payload's
length and its xxh3-64, seeded with the format's fingerprint) and each state
tensor's bytes in the model's own dtypes. ``unpack`` refuses any page that
does not check out (a lossy level, damage, another format), so a state is
exact or not used. Nothing is unpickled.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from tiercache.blocks.keys import MAX_TOKEN_ID
from tiercache.blocks.layout import HF_KV_AND_STATE_LAYERS, HF_PLAIN_KV_LAYERS, UnsupportedModelError

__all__ = ["StateFormat", "StateTensor", "has_state_layers", "layer_kinds", "read_pages", "write_pages"]

STATE_LAYER_TYPES = frozenset({"linear_attention", "conv"})
"""transformers' cache layer types that keep a state only (K/V only: ``HF_PLAIN_KV_LAYERS``; both, Falcon-H1's
parallel layers: ``HF_KV_AND_STATE_LAYERS``)."""
NO_CACHE_LAYER_TYPES = frozenset({"dummy", "moe", "mlp"})
STATE_MAGIC = b"TCSTATE1"
_HEADER = struct.Struct("<8sQQQ")
"""magic, prefix length in tokens, payload bytes, xxh3-64 of the payload."""
STATE_MARKER = MAX_TOKEN_ID
"""The marker tokens of a state chain: ids no vocabulary reaches, page ``j`` of a state filled with
``STATE_MARKER - j``, so no prompt's chain ever equals a state's."""
CHUNKED_PREFILL_IGNORES_STATE = frozenset({"jamba"})
"""Model types whose multi-token forward does not start from the cached state in transformers 5.24
(``modeling_jamba``: its scan "does not take the past state"): a prefix restored there would be continued
from zeros, so they are refused."""


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one layer: ``kind`` ``conv`` or ``recurrent``, its index in the layer, shape, dtype."""

    layer: int
    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def fields(self) -> list[Any]:
        return [self.layer, self.kind, self.index, list(self.shape), str(self.dtype).removeprefix("torch.")]


def has_state_layers(config: Any) -> bool:
    """Whether a transformers config's layers include a state layer (a hybrid model's)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return bool(set(get_layer_types_and_kwargs(text)[0]) & (STATE_LAYER_TYPES | HF_KV_AND_STATE_LAYERS))


def layer_kinds(config: Any) -> list[tuple[str, int]]:
    """Each layer's cache, ``kv``, ``state``, ``both`` or ``none``, with its number of states, from the config.

    Raises ``UnsupportedModelError`` for a layer type tiercache cannot save (chunked or indexed attention,
    compressed caches) and for model types whose chunked prefill ignores a cached state.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in CHUNKED_PREFILL_IGNORES_STATE:
        raise UnsupportedModelError(f"{text.model_type}: its multi-token forward in transformers does not start "
                                    "from the cached state, so a restored prefix would be continued wrongly")
    kinds = []
    for layer_type, kwargs in zip(*get_layer_types_and_kwargs(text), strict=True):
        states = kwargs.get("number_of_states", 1)
        if layer_type in HF_PLAIN_KV_LAYERS:
            kinds.append(("kv", 0))
        elif layer_type in STATE_LAYER_TYPES:
            kinds.append(("state", states))
        elif layer_type in HF_KV_AND_STATE_LAYERS:
            kinds.append(("both", states))
        elif layer_type in NO_CACHE_LAYER_TYPES:
            kinds.append(("none", 0))
        else:
            raise UnsupportedModelError(f"{text.model_type}: layers of type {layer_type} are not cached by tiercache")
    return kinds


@dataclass(frozen=True)
class StateFormat:
    """Every state tensor of a hybrid model, in order: what a state page holds and how many pages it takes."""

    tensors: tuple[StateTensor, ...]
    page_bytes: int
    """Bytes of one pool page (``KVLayout.bytes_per_block``)."""

    @classmethod
    def probe(cls, model: Any, page_bytes: int) -> StateFormat:
        """The model's state tensors, read from a one-token forward on its own ``DynamicCache``."""
        from tiercache.integrations.transformers.paged_cache import cache_argument

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.zeros((1, 1), dtype=torch.long, device=model.device), **cache_argument(model, cache),
                  use_cache=True)
        tensors = []
        for index, layer in enumerate(cache.layers):
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                continue
            for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                for slot, tensor in sorted(states.items()):
                    if tensor is not None:
                        tensors.append(StateTensor(index, kind, slot, tuple(tensor.shape), tensor.dtype))
        return cls(tuple(tensors), page_bytes)

    def fields(self) -> list[list[Any]]:
        """The format as JSON data (part of the namespace's page format)."""
        return [tensor.fields() for tensor in self.tensors]

    @property
    def payload_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def pages(self) -> int:
        """Pool pages one state takes, header included."""
        return -(-(_HEADER.size + self.payload_bytes) // self.page_bytes)

    def _seed(self) -> int:
        return xxhash.xxh3_64_intdigest(repr(self.fields()).encode())

    def snapshot(self, cache: Any) -> list[torch.Tensor]:
        """Copies of the state tensors in ``cache``, where they are (a decode keeps one per block boundary it crosses
        and packs only the last: no copy to the host per boundary)."""
        return [_tensor_of(cache, tensor).detach().clone() for tensor in self.tensors]

    def pack(self, state: Any, tokens: int) -> torch.Tensor:
        """The state in a cache, or a ``snapshot`` of one, after ``tokens`` positions, as ``pages * page_bytes``
        uint8 on the CPU."""
        values = state if isinstance(state, list) else [_tensor_of(state, tensor) for tensor in self.tensors]
        parts = [value.detach().to("cpu").contiguous().view(torch.uint8).flatten() for value in values]
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        digest = xxhash.xxh3_64_intdigest(payload.numpy().tobytes(), seed=self._seed())
        header = torch.frombuffer(bytearray(_HEADER.pack(STATE_MAGIC, tokens, payload.numel(), digest)),
                                  dtype=torch.uint8)
        packed = torch.zeros(self.pages * self.page_bytes, dtype=torch.uint8)
        packed[: _HEADER.size] = header
        packed[_HEADER.size : _HEADER.size + payload.numel()] = payload
        return packed

    def unpack(self, packed: torch.Tensor, tokens: int) -> list[torch.Tensor] | None:
        """The state tensors in ``packed`` (from ``pack``), or None unless it is this format's state after
        exactly ``tokens`` positions, byte for byte."""
        data = packed.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        if len(data) < _HEADER.size:
            return None
        magic, length, size, digest = _HEADER.unpack_from(data)
        if magic != STATE_MAGIC or length != tokens or size != self.payload_bytes:
            return None
        payload = data[_HEADER.size : _HEADER.size + size]
        if xxhash.xxh3_64_intdigest(payload, seed=self._seed()) != digest:
            return None
        out, offset = [], 0
        for tensor in self.tensors:
            raw = torch.frombuffer(bytearray(payload[offset : offset + tensor.nbytes]), dtype=torch.uint8)
            out.append(raw.view(tensor.dtype).reshape(tensor.shape))
            offset += tensor.nbytes
        return out

    def restore(self, layers: Sequence[Any], tensors: Sequence[torch.Tensor], tokens: int, device: Any) -> None:
        """Put ``tensors`` (from ``unpack``) into the state layers of a fresh cache, as after ``tokens`` positions."""
        for spec, value in zip(self.tensors, tensors, strict=True):
            layer = layers[spec.layer]
            value = value.to(device).clone()
            if spec.kind == "conv":
                layer.conv_states[spec.index] = value
                layer.is_conv_states_initialized[spec.index] = True
                layer.conv_kernel_size[spec.index] = value.shape[-1]
            else:
                layer.recurrent_states[spec.index] = value
                layer.is_recurrent_states_initialized[spec.index] = True
            layer.has_previous_state[spec.index] = True
            layer.dtype, layer.device = value.dtype, value.device
            layer.cumulative_length_linear = torch.tensor(tokens, dtype=torch.long, device=value.device)

    def state_tokens(self, prefix: Any, block_size: int) -> np.ndarray:
        """The chain of the state after ``prefix`` (token ids, a whole number of blocks): ``prefix`` then its marker
        pages, as int64 (hashed as fast as a prompt)."""
        marker = np.repeat(STATE_MARKER - np.arange(self.pages, dtype=np.int64), block_size)
        return np.concatenate([np.asarray(prefix, dtype=np.int64), marker])


def _tensor_of(cache: Any, tensor: StateTensor) -> torch.Tensor:
    layer = cache.layers[tensor.layer]
    states = layer.conv_states if tensor.kind == "conv" else layer.recurrent_states
    value = states[tensor.index]
    if value is None:
        raise ValueError(f"layer {tensor.layer} holds no {tensor.kind} state {tensor.index} yet")
    return value


def _pieces(pool: Sequence[torch.Tensor], block: int) -> list[torch.Tensor]:
    """A pool block's bytes, one flat uint8 view per pool tensor (one for block-major, one per layer otherwise)."""
    return [tensor[block].view(torch.uint8).flatten() for tensor in pool]


def write_pages(pool: Sequence[torch.Tensor], blocks: Sequence[int], packed: torch.Tensor) -> None:
    """Copy ``packed`` (``StateFormat.pack``) into the pool ``blocks``, in order."""
    offset = 0
    for block in blocks:
        for piece in _pieces(pool, block):
            piece.copy_(packed[offset : offset + piece.numel()])
            offset += piece.numel()
    if offset != packed.numel():
        raise ValueError(f"write_pages: {len(blocks)} blocks hold {offset} bytes, the state {packed.numel()}")


def read_pages(pool: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """The bytes of the pool ``blocks``, in order, on the CPU."""
    return torch.cat([piece.to("cpu") for block in blocks for piece in _pieces(pool, block)])
