"""``KVCoding``: a tier's lossy levels for one geometry, encoding blocks and decoding values straight into slots.

It is what a reader's ``tiercache.blocks.codec.Codec`` decodes coded values with
(``ValueCoding``): it reads exactly the lossy levels the tier's ``codec`` lists,
so a tier that lists none reads none (its ``Codec`` has no coding at all).

A stored value of a lossy level is its integrity word (xxh3-64 of the rest,
seeded with the level's coding, ``INTEGRITY_BYTES``), then the level's payload
(``tiercache.codecs.int8``, ``tiercache.codecs.compact``). ``decode_into``
refuses a value whose word does not match, then one its level's decoder finds
it never wrote (lengths, scales, the entropy stream's end), so a damaged value
is refused here, never decoded, whatever checked it before; a refusal leaves
``dest`` untouched (``Codec`` answers ``BAD_CODING``: a damaged miss).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import xxhash

from tiercache.blocks.value_format import HEADER_SIZE, CodedPayload
from tiercache.codecs.compact import CompactCoder
from tiercache.codecs.geometry import KVGeometry, UnsupportedPages
from tiercache.codecs.int8 import SCALE_BYTES, decode_int8, encode_int8
from tiercache.codecs.levels import CODING_LEVELS, Level, level_key
from tiercache.codecs.tables import CompactTables

BITS_PER_BYTE = 8
INTEGRITY_BYTES = 8
"""Bytes of the integrity word before a lossy value's payload (xxh3-64)."""
SIZE_SMOOTHING = 0.05
"""Weight of the newest value's size in a level's mean size (sizes vary a little from block to block)."""


class KVCoding:
    """The lossy ``levels`` of one geometry (``tables`` for the compact level); ``UnsupportedPages`` for a level that
    cannot read the geometry's blocks (compact on an engine's pages)."""

    def __init__(self, geometry: KVGeometry, levels: Sequence[Level], tables: CompactTables | None = None) -> None:
        self.geometry = geometry
        self.levels = [level for level in levels if level.lossy]
        for level in self.levels:
            why = geometry.unreadable(level)
            if why is not None:
                raise UnsupportedPages(f"level {level.value}: {why}")
        self.compact = None
        if Level.COMPACT in self.levels:
            if tables is None:
                raise ValueError("the compact level needs its tables")
            self.compact = CompactCoder(geometry, tables)
        self.tables_digest = tables.digest if tables is not None else b""
        self._codings = {level.coding for level in self.levels}
        self._sizes = {level: float(self._prior_size(level, tables)) for level in self.levels}
        self._decode_seconds = dict.fromkeys(self.levels, 0.0)
        self._decoded_bytes = dict.fromkeys(self.levels, 0)
        self._lock = threading.Lock()
        """Guards the sizes and decode times, which the tiers' I/O threads update."""

    def _prior_size(self, level: Level, tables: CompactTables | None) -> float:
        """A value's expected bytes at ``level`` before any was seen (for compact: the tables' entropy)."""
        geometry = self.geometry
        if level is Level.INT8:
            return HEADER_SIZE + INTEGRITY_BYTES + geometry.groups * (SCALE_BYTES + geometry.group_size)
        assert tables is not None and self.compact is not None
        bits = 0.0
        for pair in tables.probabilities:
            for probabilities in pair:
                bits -= float(np.sum(probabilities * np.log2(probabilities)))
        head = HEADER_SIZE + INTEGRITY_BYTES + self.compact.head_bytes
        return head + bits * self.compact.others * geometry.channels / BITS_PER_BYTE

    def wire_bytes(self, level: Level) -> float:
        """A value's mean bytes at ``level`` (header included), as encoded and decoded here so far."""
        if level is Level.EXACT:
            return float(HEADER_SIZE + self.geometry.block_bytes)
        return self._sizes[level]

    def decoded(self, level: Level) -> tuple[int, float]:
        """Raw bytes decoded at ``level`` in this process so far, and the seconds it took."""
        with self._lock:
            return self._decoded_bytes.get(level, 0), self._decode_seconds.get(level, 0.0)

    def _saw(self, level: Level, size: int, seconds: float = 0.0, decoded: int = 0) -> None:
        with self._lock:
            self._sizes[level] += SIZE_SMOOTHING * (HEADER_SIZE + size - self._sizes[level])
            self._decode_seconds[level] += seconds
            self._decoded_bytes[level] += decoded

    def key(self, key: bytes, level: Level) -> bytes:
        """Where a block's value at ``level`` is stored (``levels.level_key``)."""
        return level_key(key, level, self.tables_digest if level is Level.COMPACT else b"")

    def encode(self, level: Level, block: memoryview) -> CodedPayload:
        """``block`` at a lossy ``level``, ready for ``Codec.encode``."""
        if level is Level.INT8:
            data = encode_int8(self.geometry, block)
        elif level is Level.COMPACT and self.compact is not None:
            data = self.compact.encode(block)
        else:
            raise ValueError(f"level {level.value} is not one of this coding's {[lv.value for lv in self.levels]}")
        stored = integrity_word(level.coding, data) + data
        self._saw(level, len(stored))
        return CodedPayload(level.coding, stored, len(block))

    def reads(self, coding: int) -> bool:
        return coding in self._codings

    def decode_into(self, coding: int, stored: memoryview, dest: memoryview) -> bool:
        """Decode ``stored`` into ``dest``; False when it is refused (``refusal``), ``dest`` then untouched."""
        return self.refusal(coding, stored, dest) is None

    def refusal(self, coding: int, stored: memoryview, dest: memoryview) -> str | None:
        """Decode ``stored`` into ``dest``; why it was refused (``dest`` untouched), None when decoded."""
        level = CODING_LEVELS.get(coding)
        if len(dest) != self.geometry.block_bytes or level not in self.levels:
            return f"coding {coding} into {len(dest)} bytes: not one of this coding's levels and blocks"
        started = time.perf_counter()
        payload = memoryview(stored)[INTEGRITY_BYTES:]
        if len(stored) < INTEGRITY_BYTES or bytes(stored[:INTEGRITY_BYTES]) != integrity_word(coding, payload):
            return "an integrity word that does not match the payload"
        if level is Level.INT8:
            why = decode_int8(self.geometry, payload, dest)
        else:
            assert self.compact is not None
            why = self.compact.decode_into(payload, dest)
        if why is None:
            self._saw(level, len(stored), time.perf_counter() - started, len(dest))
        return why


def integrity_word(coding: int, payload: memoryview | bytes) -> bytes:
    """What a lossy value of ``coding`` carries before ``payload``: xxh3-64 of it, seeded with the coding."""
    return xxhash.xxh3_64_digest(payload, seed=coding)
