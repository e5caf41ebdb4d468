"""Pages of real-looking float KV as vLLM lays them out, and the ``int8`` level's stated bound over page groups.

``cpu_page`` lays one layer's K/V of a block out as vLLM's CPU backend does (0.32,
LBHNC: per head ``[2 * block, head_size]``, K stored transposed as the ``vec``
kernel writes it, then V row-major); ``value_page`` makes a page of seeded
values for a test's "model"; ``within_int8_bound`` checks a decoded page against
``tiercache.codecs.int8``'s bound, group by group, and ``compact_bound`` is the
compact level's stated bound per value (bounds, never equality).
"""

from __future__ import annotations

import hashlib

import torch

from tiercache.codecs.int8 import INT8_MAX
from tiercache.codecs.tables import CHUNK_TOKENS, CompactTables

DTYPE_RELATIVE_ERROR = {"float32": 2**-23, "float16": 2**-10, "bfloat16": 2**-7, "float8_e4m3fn": 2**-3}
"""Half an ulp of each engine dtype, relative: the decoded value is rounded to it once more."""
SCALE_ROUNDING = 1 + 2**-10
"""The scale is stored as float16: its step may be that much larger than absmax / 127."""
TINY = 1e-6


def int8_page_bound(original: torch.Tensor, group: int, dtype: str) -> torch.Tensor:
    """Per element of ``original`` (any shape, float32): half a step of its group's scale, plus the dtype's rounding."""
    grouped = original.reshape(-1, group)
    scale = grouped.abs().amax(-1, keepdim=True) / INT8_MAX
    return (scale / 2 * SCALE_ROUNDING + grouped.abs() * DTYPE_RELATIVE_ERROR[dtype] * 2 + TINY).reshape(original.shape)


def within_int8_bound(original: torch.Tensor, decoded: torch.Tensor, group: int) -> bool:
    """Whether every element of ``decoded`` lies within the int8 bound of ``original`` (same dtype and shape)."""
    dtype = str(original.dtype).removeprefix("torch.")
    reference = original.float()
    error = (decoded.float() - reference).abs()
    return bool((error <= int8_page_bound(reference, group, dtype)).all())


def cpu_page(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One layer's page of a block as vLLM's CPU backend keeps it: ``k``, ``v`` are ``[tokens, heads, head_size]``;
    the page is ``[heads, 2 * tokens, head_size]`` (K transposed per head, then V)."""
    tokens, heads, size = k.shape
    keys = k.permute(1, 2, 0).reshape(heads, tokens, size)  # [heads, head_size, tokens] laid as tokens rows
    return torch.cat([keys, v.permute(1, 0, 2)], dim=1).contiguous()


def value_page(seed: object, elements: int, dtype: torch.dtype, group: int) -> torch.Tensor:
    """``elements`` seeded values in ``dtype``: normal, each group at its own magnitude (as heads and channels are),
    with an outlier now and then, as real K has."""
    digest = hashlib.sha256(repr(seed).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    values = torch.randn(elements // group, group, generator=generator)
    values *= torch.rand(elements // group, 1, generator=generator) * 4 + 0.05
    outliers = torch.rand(values.shape, generator=generator) < 0.01
    values[outliers] *= 8
    return values.flatten().to(dtype)


def compact_bound(original: torch.Tensor, tables: CompactTables, dtype: str) -> torch.Tensor:
    """The module's stated bound: anchors as int8; other values half a step from the decoded anchor plus their
    delta, plus what lies beyond the clipped range, plus the dtype's rounding."""
    steps = torch.from_numpy(tables.steps)[:, :, None, :]
    half = torch.from_numpy(tables.half_alphabet).float()[:, :, None, None]
    anchors = original[:, :, ::CHUNK_TOKENS]
    anchor_error = anchors.abs().amax(-1, keepdim=True) / INT8_MAX / 2 * (1 + 2**-10)
    chunk = torch.arange(original.shape[2]) // CHUNK_TOKENS
    delta = original - anchors[:, :, chunk]
    beyond = (delta.abs() + anchor_error[:, :, chunk] - (half - 1) * steps).clamp_min(0)
    bound = anchor_error[:, :, chunk] * 2 + steps / 2 + beyond
    bound[:, :, ::CHUNK_TOKENS] = anchor_error
    return bound + original.abs() * DTYPE_RELATIVE_ERROR[dtype] * 2 + TINY
