"""The YAML ``options`` of a ``regional`` tier, and its modes (DESIGN.md, "Central and regional sync").

Each field's docstring says what it does. Connection options have the Redis
tier's names and meanings (``timeout_s``, ``connect_timeout_s``, ``username``,
``password``, ``ssl``, ``ssl_ca``, ``ssl_cert``, ``ssl_key``, ``ssl_verify``,
``connections``, ``pipeline_bytes``, ``stage_reads``, ``allow_unbounded``,
``breaker_*``; see ``tiers/redis/options.py``) and apply to central and region
alike; ``redis_options`` turns them into one ``RedisOptions`` per server. The old
``socket_timeout_ms`` is still accepted (a ``DeprecationWarning``, logged once).
``key_prefix`` keeps its own default, ``tc:`` (the Redis tier's is
``tiercache:``): changing it would orphan the values already stored. Shutdown: ``close`` gives queued
replications ``close_flush_ms``, then the background tasks (replication workers,
invalidator) ``close_timeout_ms`` to stop and the connections ``close_timeout_ms``
to close; whatever is left is abandoned with a log line, so ``close`` never
hangs on a remote. Retention: ``central_ttl_s`` gives central's values and
version keys a TTL; without it central should have an ``allkeys-*`` policy, else
a full central refuses commits and the tier removes the oldest values itself to
make room (checked and logged at start, see ``retention`` and ``room``).
"""

from __future__ import annotations

import enum
import logging
import warnings
from dataclasses import dataclass

from tiercache.config.validate import (
    MAX_RETRIES,
    int_in_range,
    positive_timeout_ms,
    positive_timeout_s,
    queue_size,
    redis_url,
    worker_count,
)
from tiercache.tiers.redis.options import RedisOptions

log = logging.getLogger(__name__)
MS_PER_SECOND = 1000.0
DEPRECATED_NAMES = {"socket_timeout_ms": "timeout_s"}
"""Old option names and the Redis tier's names that replace them."""
_warned: set[str] = set()
"""Old names already logged (each is logged once per process)."""


def _deprecated(old: str) -> None:
    """Warn that ``old`` is deprecated (a ``DeprecationWarning`` each time, a log line once)."""
    message = f"regional tier option {old!r} is deprecated: use {DEPRECATED_NAMES[old]!r} (the Redis tier's name)"
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    if old not in _warned:
        _warned.add(old)
        log.warning(message)


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
    """Not the Redis tier's ``tiercache:``: existing regional data lives under ``tc:``."""
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
    timeout_s: float = 0.5
    """A socket operation that makes no progress for this long fails (the Redis tier's ``timeout_s``)."""
    connect_timeout_s: float = 0.5
    username: str | None = None
    """Overrides the URLs' user name (central and region alike); likewise ``password``."""
    password: str | None = None
    ssl: bool = False
    """TLS to both servers (also implied by a ``rediss://`` URL); ``ssl_*`` as in the Redis tier."""
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None
    ssl_verify: bool = True
    connections: int | None = None
    """Data-path connections per server (null: by block size, as in the Redis tier)."""
    pipeline_bytes: int = 6 << 20
    stage_reads: bool = False
    allow_unbounded: bool = False
    """Write to a region without ``maxmemory`` (refused otherwise, as in the Redis tier)."""
    socket_timeout_ms: float | None = None
    """Deprecated: ``timeout_s`` in milliseconds."""
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
        for name in ("retry_backoff_ms", "close_flush_ms", "close_timeout_ms"):
            positive_timeout_ms(name, getattr(self, name))
        if self.socket_timeout_ms is not None:
            positive_timeout_ms("socket_timeout_ms", self.socket_timeout_ms)
            _deprecated("socket_timeout_ms")
            self.timeout_s = self.connect_timeout_s = self.socket_timeout_ms / MS_PER_SECOND
        for name in ("breaker_backoff_s", "breaker_backoff_max_s", "timeout_s", "connect_timeout_s"):
            positive_timeout_s(name, getattr(self, name))
        self.redis_options(self.central_url)  # the Redis tier's checks of the shared options
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
        for name in ("retry_backoff_ms", "close_flush_ms", "close_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def redis_options(self, url: str) -> RedisOptions:
        """The Redis tier's options for the data path to the server at ``url`` (central or region)."""
        return RedisOptions(
            url=url,
            key_prefix=self.key_prefix,
            username=self.username,
            password=self.password,
            ssl=self.ssl,
            ssl_ca=self.ssl_ca,
            ssl_cert=self.ssl_cert,
            ssl_key=self.ssl_key,
            ssl_verify=self.ssl_verify,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            connections=self.connections,
            pipeline_bytes=self.pipeline_bytes,
            stage_reads=self.stage_reads,
            allow_unbounded=self.allow_unbounded,
            breaker_failures=self.breaker_failures,
            breaker_backoff_s=self.breaker_backoff_s,
            breaker_backoff_max_s=self.breaker_backoff_max_s,
        )


