"""The ``int8`` level: each group of contiguous values as 8-bit integers under one scale.

A group is what the geometry calls one (``KVGeometry.vectors``): for a
``KVLayout``, a token's K (or V) of a layer over its channels (heads x head
size); for an engine's pages, ``group_elements`` contiguous elements (vLLM's
head size). Its scale is the group's largest magnitude over ``INT8_MAX``,
stored as float16 (symmetric: -127..127). Stated bound: each value decodes
within half a step (``scale / 2``) of its float16-rounded scale's grid, that is
within ``absmax / 254`` of its group (plus the engine dtype's own rounding).
Payload: the scales (float16, one per group, in order), then the integers
(``[groups, channels]``).
"""

from __future__ import annotations

import numpy as np
import torch

from tiercache.codecs.geometry import KVGeometry

INT8_MAX = 127
"""The largest magnitude a value is quantized to (symmetric: -127..127)."""
TINY_SCALE = 1e-8
"""A group whose values are all zero still gets a non-zero scale."""


def token_scales(values: torch.Tensor) -> torch.Tensor:
    """Per vector of the last axis, its largest magnitude over ``INT8_MAX`` (rounded to float16, as stored)."""
    return (values.abs().amax(-1, keepdim=True).clamp_min(TINY_SCALE) / INT8_MAX).half().float()


def quantize_tokens(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values`` as integers in [-127, 127] under ``scales`` (float32 tensor holding integers)."""
    return torch.round(values / scales).clamp(-INT8_MAX, INT8_MAX)


def encode_int8(geometry: KVGeometry, block: memoryview) -> bytes:
    """The int8 payload of one block."""
    values = geometry.vectors(block)
    scales = token_scales(values)
    integers = quantize_tokens(values, scales).to(torch.int8)
    return scales.half().numpy().tobytes() + integers.numpy().tobytes()


def decode_int8(geometry: KVGeometry, stored: memoryview, dest: memoryview) -> bool:
    """Decode an int8 payload into ``dest``; False when its length is not this geometry's."""
    count = geometry.groups
    scale_bytes = count * 2
    if len(stored) != scale_bytes + count * geometry.group_size:
        return False
    scales = torch.from_numpy(np.frombuffer(stored, dtype=np.float16, count=count).astype(np.float32))
    integers = torch.from_numpy(np.frombuffer(stored, dtype=np.int8, offset=scale_bytes).astype(np.float32))
    values = integers.view(count, geometry.group_size)
    values.mul_(scales.view(count, 1))
    geometry.write(values, dest)
    return True
