"""The moves the hierarchy asks for, as values: copies between the local tiers and remote puts.

The pure bookkeeping (``MemoryTiers``, ``Hierarchy``) never moves a byte: it
decides, under the manager's lock, and appends a move to its outbox. The
manager hands each move to the queue that runs it (the swap queue for copies,
the transfer queue for puts) and reports the outcome back to the hierarchy,
which may answer with further moves (a block that reached the CPU tier is
written through to a remote).
"""

from __future__ import annotations

import enum
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


Move = HostCopy | RemotePut
