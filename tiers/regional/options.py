"""The YAML ``options`` of a ``regional`` tier, and its modes (DESIGN.md, "Central and regional sync").

Each field's docstring says what it does. Shutdown: ``close`` gives queued
replications ``close_flush_ms``, then the background tasks (replication workers,
invalidator) ``close_timeout_ms`` to stop and the connections ``close_timeout_ms``
to close; whatever is left is abandoned with a log line, so ``close`` never
hangs on a remote. Retention: ``central_ttl_s`` gives central's values and
version keys a TTL; without it central needs an ``allkeys-*`` policy, else a full
central refuses commits (checked and logged at start, see ``retention``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tiercache.validate import (
    MAX_RETRIES,
    int_in_range,
    positive_timeout_ms,
    positive_timeout_s,
    queue_size,
    redis_url,
    worker_count,
)


class SyncMode(enum.Enum):
    """Where engines read and write (DESIGN.md)."""

    CENTRAL = "central"
    """Read and write the central store directly."""
    REGIONAL = "regional"
    """Read and write the region; replicate writes to central; read through on a miss."""


@dataclass
class RegionalOptions:
    """The YAML ``options`` of a ``regional`` tier."""

    central_url: str
    region_url: str = ""
    """Required in ``regional`` mode."""
    mode: SyncMode = SyncMode.REGIONAL
    key_prefix: str = "tc:"
    channel: str = "tiercache:updates"
    """Central's pub/sub channel of committed versions."""
    invalidate: bool = True
    """Subscribe to the channel and drop older regional copies early."""
    replication_queue_blocks: int = 4096
    replication_workers: int = 2
    replication_batch_blocks: int = 32
    replication_retries: int = 5
    retry_backoff_ms: float = 20.0
    """First retry pause; doubles per attempt."""
    socket_timeout_ms: float = 500.0
    breaker_failures: int = 3
    """Consecutive failures after which calls to that server fail at once (misses) for a back-off."""
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0
    close_flush_ms: float = 2000.0
    """How long ``close`` lets queued replications finish."""
    close_timeout_ms: float = 1000.0
    """How long ``close`` waits for background tasks, then for connections, to stop before abandoning them."""
    compress: bool = False
    central_ttl_s: float = 0.0
    """TTL of the values and version keys each commit writes at central (0: none); see ``retention``."""

    def __post_init__(self) -> None:
        redis_url("central_url", self.central_url)
        if self.region_url:
            redis_url("region_url", self.region_url)
        worker_count("replication_workers", self.replication_workers)
        queue_size("replication_queue_blocks", self.replication_queue_blocks)
        queue_size("replication_batch_blocks", self.replication_batch_blocks)
        int_in_range("replication_retries", self.replication_retries, 0, MAX_RETRIES)
        int_in_range("breaker_failures", self.breaker_failures, 1, MAX_RETRIES)
        for name in ("retry_backoff_ms", "socket_timeout_ms", "close_flush_ms", "close_timeout_ms"):
            positive_timeout_ms(name, getattr(self, name))
        for name in ("breaker_backoff_s", "breaker_backoff_max_s"):
            positive_timeout_s(name, getattr(self, name))
        if self.mode is SyncMode.REGIONAL and not self.region_url:
            raise ValueError("region_url is required in regional mode")
        for name in ("replication_queue_blocks", "replication_workers", "replication_batch_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replication_retries < 0:
            raise ValueError(f"replication_retries must be >= 0, got {self.replication_retries}")
        if self.breaker_failures < 1 or not 0 < self.breaker_backoff_s <= self.breaker_backoff_max_s:
            raise ValueError("need breaker_failures >= 1 and 0 < breaker_backoff_s <= breaker_backoff_max_s")
        if self.central_ttl_s < 0:
            raise ValueError(f"central_ttl_s must be >= 0, got {self.central_ttl_s}")
        for name in ("retry_backoff_ms", "socket_timeout_ms", "close_flush_ms", "close_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


