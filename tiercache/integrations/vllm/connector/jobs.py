"""Jobs sent to the workers and not yet reported by every one of them: a load holds its fetch, a store its slots.

A job is done once every worker reported it (``metadata.TierCacheWorkerMetadata``,
summed over the workers by vLLM), and failed if any of them failed it; only then
does the scheduler side act on it (a load's pins go, a store's slots are
committed and written down, or given up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiercache.manager.lower_tiers import HostFetch


@dataclass(eq=False, kw_only=True)
class InFlight:
    """How many workers have reported a job, and whether any failed it."""

    reports: int = 0
    failed: bool = False

    def reported(self, count: int, failed: bool, world: int) -> bool:
        """``count`` more workers reported the job (``failed``: as failed); whether all ``world`` have now."""
        self.reports += count
        self.failed |= failed
        return self.reports >= world


@dataclass(eq=False, kw_only=True)
class InFlightLoad(InFlight):
    """A load: the workers copy the fetch's slots into vLLM's blocks; the fetch's pins go once they all have."""

    fetch: HostFetch
    request_id: str


@dataclass(eq=False, kw_only=True)
class InFlightStore(InFlight):
    """A store: the workers copy vLLM's blocks into ``slots``; then the slots are committed under ``keys``."""

    request: Any
    keys: list[bytes]
    slots: list[int]
    positions: list[int] = field(default_factory=list)
    """The block positions in the request of the event group's blocks (for KV events)."""


InFlightJob = InFlightLoad | InFlightStore
