"""The levels a remote tier stores KV at, and a tier's ``codec`` option (``CodecConfig``).

A level is one encoding of a block: ``exact`` (the engine's bytes, the value
format tiercache always had), ``int8`` (8 bits per value, a scale per token's head) or
``compact`` (CacheGen's encoding, see ``compact``). Levels are copies: each level a
tier stores is its own value, under a key of its own (``level_key``), so a read
moves only the bytes of the level it chose, and an exact reader, whose keys are
the block keys themselves, never meets a lossy value.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from tiercache.common.fields import FieldError, int_in_range

LEVEL_KEY_PERSON = b"tiercache-level"
"""BLAKE2b personalisation of a level's key, so it is never the key of anything else."""
LOSSY_FORMAT = 2
"""The lossy values' format (2: an integrity word before the payload, ``tiercache.codecs.coding``), in every lossy
key: a reader never meets a value of another release's format, so it never deletes one as damaged."""
MAX_CHUNK_BLOCKS = 1 << 10
"""Largest ``chunk_blocks`` (more is a typo: a chunk is what one level decision covers)."""
DEFAULT_CHUNK_BLOCKS = 16
"""Blocks per chunk of a fetch (256 tokens of 16): each chunk's level is chosen from what the chunks before it
met. A chunk is one call to the tier, and small ones pay round trips for little data: with chunks of 4 blocks a
1024-token fetch at a 20 ms round trip took 1.5-1.65x the one-call read of the same level
(``benchmarks/codec_link.py``)."""


class Level(enum.Enum):
    """One encoding of a block, from the most faithful to the smallest."""

    EXACT = "exact"
    INT8 = "int8"
    COMPACT = "compact"

    @property
    def coding(self) -> int:
        """The header's coding field for values of this level (0: exact, not coded)."""
        return LEVEL_CODINGS[self]

    @property
    def lossy(self) -> bool:
        return self is not Level.EXACT


LEVEL_CODINGS = {Level.EXACT: 0, Level.INT8: 1, Level.COMPACT: 2}
"""The coding each level's values carry in their header (``tiercache.blocks.codec``)."""
CODING_LEVELS = {coding: level for level, coding in LEVEL_CODINGS.items()}


def level_key(key: bytes, level: Level, tables_digest: bytes = b"") -> bytes:
    """The key a block's value at ``level`` is stored under: the block key for ``exact``, else a keyed hash of it,
    the level, ``LOSSY_FORMAT`` and the digest of the tables it was coded with (values coded with other tables or in
    another format never share a key)."""
    if level is Level.EXACT:
        return key
    named = level.value.encode() + bytes([LOSSY_FORMAT]) + tables_digest
    digest = hashlib.blake2b(key, digest_size=len(key), person=LEVEL_KEY_PERSON,
                             salt=hashlib.blake2b(named, digest_size=16).digest())
    return digest.digest()


@dataclass(frozen=True)
class CodecConfig:
    """A remote tier's ``codec`` (YAML): the levels it stores and reads, and how a fetch picks among them.

    ``levels``: what a write stores (each level its own value) and what a read may
    load; ``[exact]`` (the default) is the exact value format, and a reader that
    lists no lossy level never loads lossy KV. ``adaptive``: each chunk of a fetch
    is read at the level the link's cost calls for (or recomputed); otherwise at
    the first level listed that the tier holds. ``tables``: the compact level's
    entropy tables (a file ``tiercache.codecs.tables`` writes). ``chunk_blocks``:
    blocks per chunk of an adaptive fetch.
    """

    levels: list[Level] = field(default_factory=lambda: [Level.EXACT])
    adaptive: bool = False
    tables: str | None = None
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS

    def __post_init__(self) -> None:
        levels = [level if isinstance(level, Level) else _level(level) for level in self.levels]
        object.__setattr__(self, "levels", levels)
        if not levels or len(set(levels)) != len(levels):
            raise FieldError("levels", f"a non-empty list of distinct levels of {[lv.value for lv in Level]}",
                             self.levels)
        if Level.COMPACT in levels and not self.tables:
            raise FieldError("tables", "the compact level's tables file (tiercache.codecs.tables writes one)",
                             self.tables)
        if self.adaptive and len(levels) < 2 and Level.EXACT in levels:
            raise FieldError("adaptive", "false with only the exact level (nothing to adapt)", self.adaptive)
        int_in_range("chunk_blocks", self.chunk_blocks, 1, MAX_CHUNK_BLOCKS)

    @property
    def lossy(self) -> bool:
        """Whether the tier stores or reads any lossy level."""
        return any(level.lossy for level in self.levels)


def _level(value: object) -> Level:
    try:
        return Level(value)
    except ValueError:
        raise FieldError("levels", f"levels among {[lv.value for lv in Level]}", value) from None
