"""The moves the bookkeeping asks for, as values: copies between the local tiers and remote puts, and their outbox.

The pure bookkeeping (``Hierarchy``, ``RemoteWrites``) never moves a byte: it
decides, under the manager's lock, and adds a move to the ``Outbox`` it shares
with the mover. The mover hands each move to the queue that runs it (the swap
queue for copies, the transfer queue for puts) and the outcome is reported
back, which may add further moves (a block that reached the CPU tier is written
through to a remote).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class Reason(enum.Enum):
    """Why a block moves; each reason is counted under its own name."""

    WRITE_THROUGH = "write_through"
    """Copied down as soon as it was stored in the tier above."""
    ADMITTED = "admitted"
    """Copied down when its hit count reached a selective tier's threshold."""
    DEMOTION = "demotion"
    """Copied down because the tier above evicted it."""
    PROMOTION = "promotion"
    """Written into a faster remote after it was read from a slower one."""


@dataclass(frozen=True)
class HostCopy:
    """Copy GPU blocks into CPU slots that are being written (ref -1) for ``keys``.

    ``before_reuse``: the GPU blocks were evicted and handed to the engine, so the
    engine's next use of them must wait for this copy (a demotion). Otherwise the
    GPU blocks are pinned until the copy lands.
    """

    keys: tuple[bytes, ...]
    gpu_ids: tuple[int, ...]
    cpu_slots: tuple[int, ...]
    reason: Reason
    before_reuse: bool = False


@dataclass(frozen=True)
class RemotePut:
    """Write CPU slots (pinned until the put lands) to the remote tier at ``lane``."""

    lane: int
    keys: tuple[bytes, ...]
    cpu_slots: tuple[int, ...]
    reason: Reason
    checksums: tuple[int | None, ...]
    """Each slot's checksum as the slot table noted it when its bytes landed (None: not taken)."""


Move = HostCopy | RemotePut


class Outbox:
    """The moves asked for and not yet taken, oldest first: the bookkeeping adds them, the mover takes them."""

    def __init__(self) -> None:
        self._moves: deque[Move] = deque()

    def add(self, move: Move) -> None:
        self._moves.append(move)

    def take(self) -> Move | None:
        """The oldest move not taken yet (None: none)."""
        return self._moves.popleft() if self._moves else None
