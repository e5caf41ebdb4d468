"""The ``int8`` level: each group of contiguous values as 8-bit integers under one scale.

A group is what the geometry calls one (``KVGeometry.vectors``): for a
``KVLayout``, one head of a token's K (or V) in a layer (the head size: a scale
per head, not per token, keeps a head of small values from sharing the step of
a head of large ones); for an engine's pages, ``group_elements`` contiguous
elements (vLLM's head size). Its scale is the group's largest magnitude over ``INT8_MAX``,
stored as float16 (symmetric: -127..127). Stated bound: each value decodes
within half a step (``scale / 2``) of its float16-rounded scale's grid, that is
within ``absmax / 254`` of its group (plus the engine dtype's own rounding;
under a subnormal float16 scale, absmax below about 0.008, up to
``INT8_MAX * SMALLEST_SCALE / 2`` more: the scale may round below absmax / 127).
Payload: the scales (float16, one per group, in order), then the integers
(``[groups, channels]``); ``KVCoding`` stores it after its integrity word
(``tiercache.codecs.coding``).

What the decoder refuses, as no encoder wrote it (``refused_groups``): a length
not this geometry's, a scale that is not a finite positive float16 (the encoder
keeps it within ``SMALLEST_SCALE``..``LARGEST_SCALE``; only KV holding NaN gets a
NaN one) and an integer -128. A group whose largest magnitude is not
``INT8_MAX`` under a normal scale is not checked here: it would double the
decode's time, and the integrity word (``tiercache.codecs.coding``) refuses it.
"""

from __future__ import annotations

import numpy as np
import torch

from tiercache.codecs.geometry import KVGeometry

INT8_MAX = 127
"""The largest magnitude a value is quantized to (symmetric: -127..127)."""
INT8_MIN = -128
"""The int8 value no encoder writes."""
SMALLEST_SCALE = 2.0**-24
"""float16's smallest subnormal, the least scale: an all-zero group gets it (a scale of 0 made its integers 0/0)."""
LARGEST_SCALE = 65504.0
"""float16's largest finite value, the greatest scale: a group beyond it (float32 or bfloat16 KV) is clipped, never
inf."""
SCALE_BYTES = 2
"""A float16 scale's bytes."""


def token_scales(values: torch.Tensor) -> torch.Tensor:
    """Per vector of the last axis, its largest magnitude over ``INT8_MAX`` (rounded to float16, as stored)."""
    return (values.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(SMALLEST_SCALE, LARGEST_SCALE).half().float()


def quantize_tokens(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values`` as integers in [-127, 127] under ``scales`` (float32 tensor holding integers)."""
    return torch.round(values / scales).clamp(-INT8_MAX, INT8_MAX)


def refused_groups(scales: np.ndarray, integers: np.ndarray) -> str | None:
    """Why ``scales`` ``[groups]`` (float16's values, as float32) and int8 ``integers`` ``[groups, size]`` are none
    an encoder wrote (None: they could be)."""
    if not ((scales > 0) & (scales < np.inf)).all():  # NaN is neither
        return "a scale that is not a finite positive float16"
    if integers.size and integers.min() == INT8_MIN:
        return f"an integer {INT8_MIN}"
    return None


def encode_int8(geometry: KVGeometry, block: memoryview) -> bytes:
    """The int8 payload of one block."""
    values = geometry.vectors(block)
    scales = token_scales(values)
    integers = quantize_tokens(values, scales).to(torch.int8)
    return scales.half().numpy().tobytes() + integers.numpy().tobytes()


def decode_int8(geometry: KVGeometry, stored: memoryview, dest: memoryview) -> str | None:
    """Decode an int8 payload into ``dest``; why it was refused (``dest`` untouched), None when decoded."""
    count = geometry.groups
    scale_bytes = count * SCALE_BYTES
    if len(stored) != scale_bytes + count * geometry.group_size:
        return f"{len(stored)} bytes, not this geometry's {scale_bytes + count * geometry.group_size}"
    scales = np.frombuffer(stored, dtype=np.float16, count=count).astype(np.float32)
    integers = np.frombuffer(stored, dtype=np.int8, offset=scale_bytes).reshape(count, geometry.group_size)
    why = refused_groups(scales, integers)
    if why is not None:
        return why
    values = torch.from_numpy(integers.astype(np.float32))
    values.mul_(torch.from_numpy(scales).view(count, 1))
    geometry.write(values, dest)
    return None
