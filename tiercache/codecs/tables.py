"""The compact level's fixed per-model tables: quantization steps and entropy models, learned once, versioned.

Per layer and K or V: the bits its deltas get (by layer depth, ``BITS_BY_DEPTH``),
a step per channel (the range that holds ``RANGE_QUANTILE`` of the deltas seen,
over ``2**bits`` steps) and the probability of every symbol (a histogram of the
symbols seen, smoothed so that none is impossible). Learned from real KV of the
model (``learn_tables``) on conversations apart from those they are judged on,
saved to a file (``save``/``load_tables``: NumPy's ``.npz``, no pickle) whose
``digest`` names them: it is in every compact value and in the key of every
compact value, so values coded with other tables are neither decoded nor
overwritten. ``TABLES_VERSION`` is the format's version.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TABLES_VERSION = 1
"""The tables file's format (a file of another version is refused)."""
CHUNK_TOKENS = 16
"""Tokens per chunk: its first token is the anchor, the others are coded as deltas from it."""
BITS_BY_DEPTH = (6, 6, 5)
"""Bits of the deltas in the first, second and last third of the layers (shallow layers matter more):
chosen by measurement on SmolLM2 and ShareGPT (docs/engines.md, "Compressed KV")."""
RANGE_QUANTILE = 0.999
"""The share of a channel's deltas its quantization range covers (the rest are clipped to its edge)."""
SMOOTHING_COUNT = 0.5
"""Added to every symbol's count, so that a symbol never seen in learning still codes."""
DIGEST_BYTES = 8
"""Bytes of the tables' digest carried in every compact value."""
LEARN_SUBSAMPLE = 7
"""Every n-th delta enters the quantile (the quantile of millions of deltas costs seconds otherwise)."""


def depth_bits(layer: int, layers: int) -> int:
    """The bits of ``layer``'s deltas (``BITS_BY_DEPTH`` by thirds of the depth)."""
    return BITS_BY_DEPTH[min(len(BITS_BY_DEPTH) - 1, layer * len(BITS_BY_DEPTH) // layers)]


def anchored(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``[..., tokens, channels]`` into chunks: (the anchors' scales, their integers, the deltas of the
    other tokens from their chunk's decoded anchor, ``[..., tokens - chunks, channels]``)."""
    from tiercache.codecs.int8 import quantize_tokens, token_scales

    tokens = values.shape[-2]
    starts = torch.arange(0, tokens, CHUNK_TOKENS)
    anchors = values[..., starts, :]
    scales = token_scales(anchors)
    integers = quantize_tokens(anchors, scales)
    chunk_of = torch.arange(tokens) // CHUNK_TOKENS
    others = torch.arange(tokens) % CHUNK_TOKENS != 0
    base = (integers * scales)[..., chunk_of[others], :]
    return scales, integers, values[..., others, :] - base


@dataclass(frozen=True)
class CompactTables:
    """Steps ``[layers, 2, channels]``, bits ``[layers]`` and symbol probabilities per (layer, K or V)."""

    steps: np.ndarray
    bits: np.ndarray
    probabilities: tuple[tuple[np.ndarray, np.ndarray], ...]

    @property
    def layers(self) -> int:
        return int(self.steps.shape[0])

    @property
    def channels(self) -> int:
        return int(self.steps.shape[2])

    @functools.cached_property
    def digest(self) -> bytes:
        """What names these tables: BLAKE2b of their version, steps, bits and probabilities."""
        digest = hashlib.blake2b(str(TABLES_VERSION).encode(), digest_size=DIGEST_BYTES)
        digest.update(self.steps.astype("<f4").tobytes())
        digest.update(self.bits.astype("<i4").tobytes())
        for pair in self.probabilities:
            for probabilities in pair:
                digest.update(probabilities.astype("<f8").tobytes())
        return digest.digest()

    def save(self, path: str | Path) -> Path:
        """Write the tables to exactly ``path`` (NumPy's ``.npz`` format, plain arrays, whatever the name ends
        in); the path written."""
        arrays = {f"p_{layer}_{kind}": self.probabilities[layer][kind]
                  for layer in range(self.layers) for kind in range(2)}
        written = Path(path)
        with written.open("wb") as out:  # a file, not a name: ``np.savez`` would add ``.npz`` to the name
            np.savez(out, version=np.array(TABLES_VERSION), steps=self.steps, bits=self.bits, **arrays)
        return written


def load_tables(path: str | Path) -> CompactTables:
    """Tables written by ``CompactTables.save``; ``ValueError`` for another version or a malformed file."""
    with np.load(path, allow_pickle=False) as data:
        if int(data["version"]) != TABLES_VERSION:
            raise ValueError(f"{path}: tables of version {int(data['version'])}, this release reads {TABLES_VERSION}")
        steps, bits = data["steps"].astype(np.float32), data["bits"].astype(np.int32)
        pairs = tuple((data[f"p_{layer}_0"], data[f"p_{layer}_1"]) for layer in range(steps.shape[0]))
    for layer, pair in enumerate(pairs):
        if any(len(p) != 1 << int(bits[layer]) for p in pair):
            raise ValueError(f"{path}: layer {layer}'s probabilities do not match its {int(bits[layer])} bits")
    return CompactTables(steps, bits, pairs)


def learn_tables(samples: Iterable[torch.Tensor]) -> CompactTables:
    """Tables learned from K/V samples, each ``[layers, 2, tokens, channels]`` (whole contexts or blocks)."""
    deltas = [anchored(sample.float())[2] for sample in samples]
    if not deltas:
        raise ValueError("learning tables needs at least one sample")
    layers, channels = deltas[0].shape[0], deltas[0].shape[-1]
    bits = np.array([depth_bits(layer, layers) for layer in range(layers)], dtype=np.int32)
    steps = np.empty((layers, 2, channels), dtype=np.float32)
    pairs = []
    for layer in range(layers):
        pair = []
        levels = 1 << int(bits[layer])
        for kind in range(2):
            seen = torch.cat([delta[layer, kind] for delta in deltas])
            spread = torch.quantile(seen.abs()[::LEARN_SUBSAMPLE], RANGE_QUANTILE, dim=0).clamp_min(1e-6)
            step = 2 * spread / levels
            steps[layer, kind] = step.numpy()
            symbols = (torch.round(seen / step).clamp(-levels // 2, levels // 2 - 1) + levels // 2).long()
            counts = torch.bincount(symbols.flatten(), minlength=levels).double().numpy() + SMOOTHING_COUNT
            pair.append(counts / counts.sum())
        pairs.append((pair[0], pair[1]))
    return CompactTables(steps, bits, tuple(pairs))
