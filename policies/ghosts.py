"""Ghost lists: the fingerprints of keys a policy evicted recently, oldest first, with O(1) membership.

ARC's B1 and B2, 2Q's A1out and S3-FIFO's ghost FIFO only ever ask "was this key here, and in which list?", so a
ghost is a 64-bit fingerprint of its key (the caller's ``hash(key)``, which a bytes key caches) in a linked
list node, found through an open-addressing table of node numbers: about 25 bytes a ghost, where the key object
and an OrderedDict entry cost about 200 (docs/architecture.md, "Eviction policies"). Two keys whose hashes
collide are one ghost: a policy's decision may differ, never the data (about one key in 10^19 per lookup).
"""

from __future__ import annotations

from array import array

from tiercache.policies.lists import NOT_LISTED, EntryLists

EMPTY = -1
"""A table cell that holds no node."""

FIBONACCI = 0x9E3779B97F4A7C15
"""2^64 / the golden ratio: spreads fingerprints over the table (integers' hashes are themselves)."""

MASK64 = (1 << 64) - 1
MIN_TABLE_BITS = 3
MAX_LOAD_SHIFT = 1
"""The table keeps at least twice as many cells as ghosts (linear probing stays short)."""


class Ghosts:
    """Numbered lists of fingerprints (keys evicted and remembered), oldest first; a fingerprint is in one list."""

    def __init__(self, lists: int, expected: int = 0) -> None:
        self._lists = EntryLists(0, lists)
        self.lengths = self._lists.lengths
        """Each list's length (read only)."""
        self._fingerprints = array("q")
        self._spare: list[int] = []  # node numbers freed by a hit or a trim
        bits = MIN_TABLE_BITS
        while (1 << bits) < expected << MAX_LOAD_SHIFT:
            bits += 1
        self._size_table(bits)

    def __len__(self) -> int:
        return len(self._fingerprints) - len(self._spare)

    def append(self, number: int, fingerprint: int) -> None:
        """Remember ``fingerprint`` at the newest end of list ``number``."""
        if self._spare:
            node = self._spare.pop()
            self._fingerprints[node] = fingerprint
        else:
            node = len(self._fingerprints)
            if (node + 1) << MAX_LOAD_SHIFT > len(self._cells):
                self._rehash(self._bits + 1)
            self._fingerprints.append(fingerprint)
            if node >= self._lists.size:
                self._lists.grow(max(2 * self._lists.size, node + 1))
        self._lists.append(number, node)
        cells, mask, home = self._cells, self._mask, ((fingerprint * FIBONACCI) & MASK64) >> self._shift
        while cells[home] != EMPTY:
            home = (home + 1) & mask
        cells[home] = node

    def take(self, fingerprint: int) -> int:
        """Forget ``fingerprint`` (a ghost hit): the number of the list it was in, or NOT_LISTED if none."""
        cells, fingerprints, mask = self._cells, self._fingerprints, self._mask
        cell = ((fingerprint * FIBONACCI) & MASK64) >> self._shift
        while True:
            node = cells[cell]
            if node == EMPTY:
                return NOT_LISTED
            if fingerprints[node] == fingerprint:
                break
            cell = (cell + 1) & mask
        self._free(cell, node)
        return self._lists.unlink(node)

    def pop_oldest(self, number: int) -> None:
        """Forget the oldest ghost of a non-empty list ``number``."""
        node = self._lists.pop_oldest(number)
        cells, mask = self._cells, self._mask
        cell = ((self._fingerprints[node] * FIBONACCI) & MASK64) >> self._shift
        while cells[cell] != node:
            cell = (cell + 1) & mask
        self._free(cell, node)

    def _free(self, cell: int, node: int) -> None:
        """Empty ``cell`` (which holds ``node``) and shift later cells of its probe run back (no tombstones)."""
        cells, fingerprints, mask, shift = self._cells, self._fingerprints, self._mask, self._shift
        hole, probe = cell, cell
        while True:
            probe = (probe + 1) & mask
            moving = cells[probe]
            if moving == EMPTY:
                break
            home = ((fingerprints[moving] * FIBONACCI) & MASK64) >> shift
            # ``moving`` may fill the hole unless its home lies cyclically in (hole, probe].
            if (probe - home) & mask >= (probe - hole) & mask:
                cells[hole] = moving
                hole = probe
        cells[hole] = EMPTY
        self._spare.append(node)

    def _size_table(self, bits: int) -> None:
        self._bits, self._mask, self._shift = bits, (1 << bits) - 1, 64 - bits
        self._cells = array("i", [EMPTY]) * (1 << bits)

    def _rehash(self, bits: int) -> None:
        self._size_table(bits)
        cells, mask, shift, spare = self._cells, self._mask, self._shift, set(self._spare)
        for node, fingerprint in enumerate(self._fingerprints):
            if node in spare:
                continue
            cell = ((fingerprint * FIBONACCI) & MASK64) >> shift
            while cells[cell] != EMPTY:
                cell = (cell + 1) & mask
            cells[cell] = node
