"""The ``compact`` level: CacheGen's encoding of a block, entropy-coded with fixed per-model tables.

The block's tokens form chunks of ``CHUNK_TOKENS``; each chunk's first token (its
anchor) is kept at 8 bits with a scale per token, and every other token is coded
as its delta from the decoded anchor (tokens close together are alike), per
channel under the tables' fixed step, at the bits the layer's depth gives its K
or V, over an alphabet wider than the learned range (``RANGE_EXTRA_BITS``), clipped
to that alphabet. The symbols of each layer's K and of
its V are entropy-coded (rANS, ``constriction``) under that layer's learned
model, in one call per layer and K or V, never per channel.

Stated bound: an anchor value decodes within ``absmax / 254`` of its token's
largest magnitude (as ``int8``); any other value within half its channel's step
of the decoded anchor plus its delta, when the delta lies within the alphabet
(``(half_alphabet - 1/2) * step``); a delta beyond it is clipped to the alphabet's edge.

Payload: the tables' digest, the anchors' scales (float16) and integers (int8),
then the entropy-coded symbols (32-bit words); ``KVCoding`` stores it after its
integrity word (``tiercache.codecs.coding``).

What the decoder refuses, as no encoder wrote it: another digest, a head that is
not this geometry's or words that are not whole, anchors an ``int8`` encoder did
not write (``int8.refused_groups``), words the entropy coder cannot read, and a
stream that does not end where the block's last symbol does (the coder not empty
after it: a cut, an extension, most flips). Words cut to none still read (an
empty coder decodes its lowest symbol, as the encoder would have written no word
for a block of them): only the integrity word refuses that.
"""

from __future__ import annotations

import functools

import constriction
import numpy as np
import torch

from tiercache.codecs.geometry import KVGeometry
from tiercache.codecs.int8 import SCALE_BYTES, refused_groups
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
        half = torch.from_numpy(tables.half_alphabet).float().view(geometry.layers, 2, 1, 1)
        self._low, self._high = -half, half - 1
        self._offset = half
        anchor_count = geometry.layers * 2 * self.chunks
        self._anchor_count = anchor_count
        self._scale_bytes = anchor_count * SCALE_BYTES
        self._anchor_bytes = anchor_count * geometry.channels
        self.head_bytes = DIGEST_BYTES + self._scale_bytes + self._anchor_bytes
        """A payload's bytes before its entropy-coded words."""

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

    def decode_into(self, stored: memoryview, dest: memoryview) -> str | None:
        """Decode a compact payload into ``dest``; why it was refused (``dest`` untouched), None when decoded."""
        geometry = self.geometry
        head = self.head_bytes
        if bytes(stored[:DIGEST_BYTES]) != self.tables.digest:
            return "another tables' digest"
        if len(stored) < head or (len(stored) - head) % WORD.itemsize:
            return f"{len(stored)} bytes: not a head of {head} and whole words"
        scales = np.frombuffer(stored, dtype=np.float16, count=self._anchor_count, offset=DIGEST_BYTES).astype(
            np.float32)
        integers = np.frombuffer(stored, dtype=np.int8, count=self._anchor_bytes,
                                 offset=DIGEST_BYTES + self._scale_bytes).reshape(self._anchor_count, -1)
        why = refused_groups(scales, integers)
        if why is not None:
            return "anchors with " + why
        symbols = self._symbols(np.frombuffer(stored, dtype=WORD, offset=head))
        if isinstance(symbols, str):
            return symbols
        shape = (geometry.layers, 2, self.chunks, 1)
        anchors = torch.from_numpy(integers.astype(np.float32)).view(geometry.layers, 2, self.chunks, -1)
        anchors.mul_(torch.from_numpy(scales).view(shape))
        deltas = torch.from_numpy(symbols).view(geometry.layers, 2, self.others, -1).float()
        deltas.sub_(self._offset).mul_(self._steps)
        values = torch.empty(geometry.layers, 2, geometry.tokens, geometry.channels)
        tokens = torch.arange(geometry.tokens)
        is_anchor = tokens % CHUNK_TOKENS == 0
        values[:, :, is_anchor] = anchors
        values[:, :, ~is_anchor] = deltas + anchors[:, :, (tokens // CHUNK_TOKENS)[~is_anchor]]
        geometry.write(values, dest)
        return None

    def _symbols(self, words: np.ndarray) -> np.ndarray | str:
        """Every (layer, K or V)'s symbols decoded from ``words``, or why they are none the encoder wrote."""
        symbols = np.empty((len(self._models), self.others * self.geometry.channels), dtype=np.int32)
        try:  # garbage words may be none the coder reads (one ending in a zero word): a refusal, not an error
            decoder = constriction.stream.stack.AnsCoder(words.astype(np.uint32))
            for index, model in enumerate(self._models):
                symbols[index] = decoder.decode(model, symbols.shape[1])
            ended = decoder.is_empty()
        except Exception as error:
            return f"entropy-coded words the coder cannot read ({error})"
        if not ended:
            return "an entropy-coded stream that does not end with the block's last symbol"
        return symbols
