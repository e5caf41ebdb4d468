"""Where vLLM's attention kernel keeps each token's K and V in a page: the token map the ``compact`` level reads.

A slot keeps vLLM's pages in its logical order, ``[heads, tokens, 2 * head_size]``
a page (``pages``); what the content holds is the attention backend's business:

* FlashAttention and FlexAttention (vLLM 0.33, ``kv_cache.transpose(1, 2).split(head_size, -1)``):
  each token's K then its V (``interleaved_map``);
* the CPU backend (``cpu_attn.py``) views a head's page as ``[2 * tokens, head_size]``,
  K's half then V's, and its kernel ISA packs K (``vec``/``vec16`` store it
  transposed; ``amx`` in tiles). The order is read from vLLM's own kernel:
  ``cpu_attn_reshape_and_cache`` writes numbered K and V into one block, in base-256
  digits a pass (exact in every float dtype), and where each number lands is the map.

Any other backend, a model of several KV-cache groups, MLA, K and V of different
sizes, or a quantized cache: no map, and ``compact`` declines (int8 still reads
the pages as groups). The map names the backends it holds for; a worker whose
layers run another declines every request rather than let a compact value decode
into the wrong order (``ConnectorWorker``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.blocks.layout import DTYPES
from tiercache.blocks.token_map import PageTokenMap, interleaved_map
from tiercache.codecs.levels import Level
from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry

if TYPE_CHECKING:  # the worker imports this module on the GPU check's machine, which has no YAML
    from tiercache.config.topology import TierCacheConfig

INTERLEAVED_BACKENDS = ("FLASH_ATTN", "FLEX_ATTENTION")
"""vLLM backends whose page holds each token's K then its V, ``[heads, tokens, 2 * head_size]``."""
CPU_BACKEND = "CPU_ATTN"
"""vLLM's CPU attention backend (its kernel's order is probed)."""
ATTENTION_SPEC = "FullAttentionSpec"
"""The one KV-cache spec whose pages hold K and V of every head (MLA's latent has no such split)."""
PROBE_BASE = 256
"""Digits a probe pass writes: 0..255 are exact in bfloat16, float16 and float32."""

log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class TokenOrder:
    """The token map of an instance's pages and the backends it holds for, or why there is none."""

    token_map: PageTokenMap | None
    backends: tuple[str, ...] = ()
    why_not: str | None = None

    def mismatch(self, backends: dict[str, str]) -> str | None:
        """Why the map does not hold for these layers' backends (None: it holds, or no map is in use)."""
        if self.token_map is None:
            return None
        other = sorted({name for name in backends.values() if name not in self.backends})
        if not other:
            return None
        return (f"the compact level reads pages as {self.token_map.source}, but layers run {other}: compact values "
                "would decode into the wrong order")


def compact_order(config: TierCacheConfig, vllm_config: Any, kv_cache_config: Any,
                  geometry: SlotGeometry) -> TokenOrder:
    """The token map of this instance's slots where a remote tier lists the compact level (nothing is probed
    otherwise); ``config``'s layout then carries it. Without one, compact declines (logged by the tier)."""
    if not any(Level.COMPACT in tier.codec.levels for tier in config.tiers[1:]):
        return TokenOrder(None)
    order = token_order(vllm_config, kv_cache_config, geometry)
    if order.token_map is None:
        log.warning("tiercache connector: no token map of vLLM's pages (%s), so the compact level declines",
                    order.why_not)
    else:
        config.layout = dataclasses.replace(config.layout, token_map=order.token_map)
        log.info("tiercache connector: the compact level reads pages as %s", order.token_map.source)
    return order


def token_order(vllm_config: Any, kv_cache_config: Any, geometry: SlotGeometry) -> TokenOrder:
    """The token map of this instance's slots (``TokenOrder.why_not`` where there is none)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or geometry.groups[0].kind is not GroupKind.FULL:
        return TokenOrder(None, why_not="a model of several KV-cache groups or a sliding window")
    spec = groups[0].kv_cache_spec
    dtype = geometry.element_dtype
    head_size, heads = int(getattr(spec, "head_size", 0)), int(getattr(spec, "num_kv_heads", 0))
    if type(spec).__name__ != ATTENTION_SPEC or dtype is None:
        return TokenOrder(None, why_not=f"{type(spec).__name__} pages of {dtype} elements")
    if getattr(spec, "head_size_v", head_size) != head_size:
        return TokenOrder(None, why_not="K and V of different head sizes")
    if geometry.groups[0].page_bytes != heads * 2 * geometry.block_size * head_size * DTYPES[dtype]:
        return TokenOrder(None, why_not="a page that is not heads x tokens x K and V")
    layers, ranks = len(geometry.groups[0].layer_names), geometry.copies
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        try:
            key, value, isa = _cpu_kernel_order(vllm_config, dtype, geometry.block_size, head_size)
            source = f"vLLM {CPU_BACKEND} ({isa} kernel, probed)"
            probed = PageTokenMap(layers, ranks, heads, head_size, geometry.block_size, key, value, source)
        except Exception as error:  # another vLLM's kernel or signature: no map rather than a wrong one
            return TokenOrder(None, why_not=f"vLLM's CPU kernel order could not be read: {error!r}")
        return TokenOrder(probed, (CPU_BACKEND,))
    source = f"vLLM {'/'.join(INTERLEAVED_BACKENDS)} (each token's K then V)"
    return TokenOrder(interleaved_map(layers, ranks, heads, head_size, geometry.block_size, source),
                      INTERLEAVED_BACKENDS)


def _cpu_kernel_order(vllm_config: Any, element_dtype: str, block_size: int,
                      head_size: int) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Where vLLM's CPU kernel puts each (token, channel) of one head's K and V in the head's region, and its ISA."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(vllm_config.model_config.dtype, block_size, head_size, cache_dtype)
    kv_dtype = getattr(torch, element_dtype)
    cells = block_size * head_size
    numbers = torch.arange(cells, dtype=torch.int64)
    found = torch.zeros(2 * cells, dtype=torch.int64)
    for digit in range(max(1, math.ceil(math.log(cells, PROBE_BASE)))):
        written = (numbers // PROBE_BASE**digit % PROBE_BASE).to(kv_dtype).view(block_size, 1, head_size)
        cache = torch.zeros(1, 1, 2 * block_size, head_size, dtype=kv_dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(written, written.clone(), key_cache, value_cache,
                                       torch.arange(block_size, dtype=torch.int64), isa, 1.0, 1.0, cache_dtype)
        found += cache.flatten().to(torch.int64) * PROBE_BASE**digit
    key, value = torch.full((cells,), -1), torch.full((cells,), -1)
    key[found[:cells]] = torch.arange(cells)
    value[found[cells:]] = torch.arange(cells, 2 * cells)
    return tuple(key.tolist()), tuple(value.tolist()), isa
