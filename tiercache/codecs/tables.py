"""The compact level's fixed per-model tables: quantization steps and entropy models, learned once, versioned.

Per layer and K or V: the bits its deltas get (``K_BITS_BY_DEPTH``,
``V_BITS_BY_DEPTH``), a step per channel (the range that holds ``RANGE_QUANTILE``
of the deltas seen, over ``2**bits`` steps), an alphabet ``2**RANGE_EXTRA_BITS``
times as wide as that range (so the rare larger deltas are coded, not clipped:
the entropy coder makes them cost bits only where they occur) and the
probability of every symbol (a histogram of the symbols seen, smoothed so that
none is impossible). Learned from real KV of the
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

TABLES_VERSION = 2
"""The tables file's format (a file of another version is refused; 1 had bits per layer and no wider alphabet)."""
CHUNK_TOKENS = 16
"""Tokens per chunk: its first token is the anchor, the others are coded as deltas from it."""
K_BITS_BY_DEPTH = (6, 7, 6)
"""Bits of K's deltas in the first, second and last third of the layers: K carries nearly all of the error a
quantized context adds (the rotary embedding makes its deltas large), most of it in the middle layers. Chosen by
measurement on SmolLM2 and ShareGPT at 1k-4k tokens (docs/engines.md, "Compressed KV")."""
V_BITS_BY_DEPTH = (5, 5, 5)
"""Bits of V's deltas by thirds of the layers (quantized alone, V adds a fifth of K's KL at one bit less)."""
RANGE_EXTRA_BITS = 2
"""The alphabet spans ``2**RANGE_EXTRA_BITS`` times the learned range: a clipped delta of K was the largest single
source of error at 2k tokens (0.3% of deltas, 3x the learned share, with a fourth of the KL)."""
RANGE_QUANTILE = 0.999
"""The share of a channel's deltas its quantization range covers (the rest are clipped to its edge)."""
SMOOTHING_COUNT = 0.5
"""Added to every symbol's count, so that a symbol never seen in learning still codes."""
DIGEST_BYTES = 8
"""Bytes of the tables' digest carried in every compact value."""
LEARN_SUBSAMPLE = 7
"""Every n-th delta enters the quantile (the quantile of millions of deltas costs seconds otherwise)."""


def depth_bits(layer: int, layers: int) -> tuple[int, int]:
    """The bits of ``layer``'s K and V deltas (``K_BITS_BY_DEPTH``, ``V_BITS_BY_DEPTH`` by thirds of the depth)."""
    third = min(len(K_BITS_BY_DEPTH) - 1, layer * len(K_BITS_BY_DEPTH) // layers)
    return K_BITS_BY_DEPTH[third], V_BITS_BY_DEPTH[third]


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
    """Steps ``[layers, 2, channels]``, bits ``[layers, 2]`` and symbol probabilities per (layer, K or V), over an
    alphabet of ``2 * half_alphabet`` symbols."""

    steps: np.ndarray
    bits: np.ndarray
    probabilities: tuple[tuple[np.ndarray, np.ndarray], ...]

    @property
    def layers(self) -> int:
        return int(self.steps.shape[0])

    @property
    def channels(self) -> int:
        return int(self.steps.shape[2])

    @property
    def half_alphabet(self) -> np.ndarray:
        """``[layers, 2]``: half of each alphabet, the symbol a delta of 0 is (symbols code ``-half..half - 1``)."""
        return 1 << (self.bits.astype(np.int64) + RANGE_EXTRA_BITS - 1)

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
    if bits.shape != (steps.shape[0], 2):
        raise ValueError(f"{path}: bits of shape {bits.shape}, not one per layer and K or V")
    tables = CompactTables(steps, bits, pairs)
    for layer, pair in enumerate(pairs):
        if any(len(p) != 2 * tables.half_alphabet[layer, kind] for kind, p in enumerate(pair)):
            raise ValueError(f"{path}: layer {layer}'s probabilities do not match its {bits[layer].tolist()} bits")
    return tables


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
        for kind in range(2):
            half = 1 << (int(bits[layer, kind]) + RANGE_EXTRA_BITS - 1)
            seen = torch.cat([delta[layer, kind] for delta in deltas])
            spread = torch.quantile(seen.abs()[::LEARN_SUBSAMPLE], RANGE_QUANTILE, dim=0).clamp_min(1e-6)
            step = 2 * spread / (1 << int(bits[layer, kind]))
            steps[layer, kind] = step.numpy()
            symbols = (torch.round(seen / step).clamp(-half, half - 1) + half).long()
            counts = torch.bincount(symbols.flatten(), minlength=2 * half).double().numpy() + SMOOTHING_COUNT
            pair.append(counts / counts.sum())
        pairs.append((pair[0], pair[1]))
    return CompactTables(steps, bits, tuple(pairs))
