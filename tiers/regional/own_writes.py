"""This node's own acknowledged writes that wait for a central version (regional mode).

A regional put is acknowledged once the region stored it and it was queued for
replication; until central gives it a version, a ``force_latest`` read of this
node may serve the regional copy only while it is still that write (same
checksum): it is the latest this node can know. A write that could not be queued
is no longer this node's to vouch for; a replication that ended (committed or
given up) leaves the set unless a newer write of the key is waiting.
"""

from __future__ import annotations


class OwnWrites:
    """Key -> checksum of this node's writes queued for replication and not yet replicated."""

    def __init__(self) -> None:
        self._checksums: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._checksums)

    def __contains__(self, key: bytes) -> bool:
        return key in self._checksums

    def offered(self, key: bytes, checksum: bytes, queued: bool) -> None:
        """A write of ``key`` was offered for replication: remembered while ``queued``, else forgotten."""
        if queued:
            self._checksums[key] = checksum
        else:
            self._checksums.pop(key, None)

    def replicated(self, key: bytes, checksum: bytes) -> None:
        """The replication of a write ended: forgotten, unless a newer write of ``key`` waits."""
        if self._checksums.get(key) == checksum:
            del self._checksums[key]

    def is_own(self, key: bytes, checksum: bytes) -> bool:
        """Whether a copy with ``checksum`` is this node's waiting write of ``key``."""
        return self._checksums.get(key) == checksum
