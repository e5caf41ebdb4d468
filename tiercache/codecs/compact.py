"""The ``compact`` level: CacheGen's encoding of a block, entropy-coded with fixed per-model tables.

The block's tokens form chunks of ``CHUNK_TOKENS``; each chunk's first token (its
anchor) is kept at 8 bits with a scale per token, and every other token is coded
as its delta from the decoded anchor (tokens close together are alike), per
channel under the tables' fixed step, at the bits the layer's depth gets (shallow
layers matter more), clipped to that range. The symbols of each layer's K and of
its V are entropy-coded (rANS, ``constriction``) under that layer's learned
model, in one call per layer and K or V, never per channel.

Stated bound: an anchor value decodes within ``absmax / 254`` of its token's
largest magnitude (as ``int8``); any other value within half its channel's step
of the decoded anchor plus its delta, when the delta lies within the range
(``(2**bits / 2 - 1/2) * step``); a delta beyond it is clipped to the range's edge.

Payload: the tables' digest, the anchors' scales (float16) and integers (int8),
then the entropy-coded symbols (32-bit words).
"""

from __future__ import annotations

import functools

import constriction
import numpy as np
import torch

from tiercache.codecs.geometry import KVGeometry
from tiercache.codecs.tables import CHUNK_TOKENS, DIGEST_BYTES, CompactTables, anchored

WORD = np.dtype("<u4")
"""The entropy coder's output unit."""


class CompactCoder:
    """Encodes and decodes one geometry's blocks with one set of tables."""

    def __init__(self, geometry: KVGeometry, tables: CompactTables) -> None:
        if (tables.layers, tables.channels) != (geometry.layers, geometry.channels):
            raise ValueError(
                f"tables for {tables.layers} layers x {tables.channels} channels, "
                f"blocks of {geometry.layers} x {geometry.channels}"
            )
        self.geometry = geometry
        self.tables = tables
        self.chunks = -(-geometry.tokens // CHUNK_TOKENS)
        self.others = geometry.tokens - self.chunks
        self._steps = torch.from_numpy(tables.steps).view(geometry.layers, 2, 1, geometry.channels)
        half = torch.from_numpy(1 << (tables.bits - 1)).float().view(-1, 1, 1, 1)
        self._low, self._high = -half, half - 1
        self._offset = half
        anchor_count = geometry.layers * 2 * self.chunks
        self._scale_bytes = anchor_count * 2
        self._anchor_bytes = anchor_count * geometry.channels

    @functools.cached_property
    def _models(self) -> list[constriction.stream.model.Categorical]:
        """One entropy model per (layer, K or V), in coding order."""
        return [constriction.stream.model.Categorical(p, perfect=False)
                for pair in self.tables.probabilities for p in pair]

    def encode(self, block: memoryview) -> bytes:
        """The compact payload of one block."""
        scales, integers, deltas = anchored(self.geometry.values(block))
        symbols = torch.round(deltas / self._steps).clamp(self._low, self._high).add(self._offset)
        flat = symbols.to(torch.int32).view(len(self._models), -1).numpy()
        coder = constriction.stream.stack.AnsCoder()
        for index in reversed(range(len(self._models))):  # a stack: the last encoded is the first decoded
            coder.encode_reverse(flat[index], self._models[index])
        words = coder.get_compressed().astype(WORD)
        return (self.tables.digest + scales.half().numpy().tobytes() + integers.to(torch.int8).numpy().tobytes()
                + words.tobytes())

    def decode_into(self, stored: memoryview, dest: memoryview) -> bool:
        """Decode a compact payload into ``dest``; False when it is not one of these tables and geometry."""
        geometry = self.geometry
        head = DIGEST_BYTES + self._scale_bytes + self._anchor_bytes
        if len(stored) < head or (len(stored) - head) % WORD.itemsize or bytes(stored[:DIGEST_BYTES]) != (
            self.tables.digest
        ):
            return False
        shape = (geometry.layers, 2, self.chunks, 1)
        scales = np.frombuffer(stored, dtype=np.float16, count=int(np.prod(shape)), offset=DIGEST_BYTES)
        integers = np.frombuffer(stored, dtype=np.int8, count=self._anchor_bytes,
                                 offset=DIGEST_BYTES + self._scale_bytes)
        words = np.frombuffer(stored, dtype=WORD, offset=head)
        decoder = constriction.stream.stack.AnsCoder(words.astype(np.uint32))
        symbols = np.empty((len(self._models), self.others * geometry.channels), dtype=np.int32)
        for index, model in enumerate(self._models):
            symbols[index] = decoder.decode(model, symbols.shape[1])
        anchors = torch.from_numpy(integers.astype(np.float32)).view(geometry.layers, 2, self.chunks, -1)
        anchors.mul_(torch.from_numpy(scales.astype(np.float32)).view(shape))
        deltas = torch.from_numpy(symbols).view(geometry.layers, 2, self.others, -1).float()
        deltas.sub_(self._offset).mul_(self._steps)
        values = torch.empty(geometry.layers, 2, geometry.tokens, geometry.channels)
        tokens = torch.arange(geometry.tokens)
        is_anchor = tokens % CHUNK_TOKENS == 0
        values[:, :, is_anchor] = anchors
        values[:, :, ~is_anchor] = deltas + anchors[:, :, (tokens // CHUNK_TOKENS)[~is_anchor]]
        geometry.write(values, dest)
        return True
