"""SlotChecksums: the ``payload_checksum`` of each local slot's bytes, noted when a copy into the slot lands.

A remote write of the block then carries it instead of reading the slot again (docs/architecture.md, Values).
Flat per slot: a 64-bit array beside a noted flag, 9 bytes a slot, where a list would hold a 36-byte int object a
block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

CHECKSUM_BYTES = 8
"""A slot's checksum: the 64-bit ``payload_checksum``."""


class SlotChecksums:
    """What each slot's current bytes hash to, if noted; forgotten when the slot is handed out again."""

    def __init__(self, num_slots: int) -> None:
        self._checksum = array("Q", bytes(CHECKSUM_BYTES * num_slots))
        self._noted = bytearray(num_slots)

    def note(self, slot: int, checksum: int) -> None:
        self._checksum[slot] = checksum
        self._noted[slot] = 1

    def forget(self, slots: Iterable[int]) -> None:
        """The slots hold other bytes from now on."""
        noted = self._noted
        for slot in slots:
            noted[slot] = 0

    def get(self, slot: int) -> int | None:
        """The checksum noted for the slot's bytes; None if none was."""
        return self._checksum[slot] if self._noted[slot] else None
