"""The YAML ``options`` of a ``regional`` tier, and its modes (docs/architecture.md, "Central and regional sync").

Each field's docstring says what it does. The connection options are the Redis
tier's own fields, inherited from ``RedisServerOptions`` (``tiers/redis/options.py``:
``timeout_s``, ``connect_timeout_s``, ``username``, ``password``, ``ssl``,
``ssl_*``, ``connections``, ``pipeline_bytes``, ``stage_reads``,
``allow_unbounded``, ``breaker_*``, ``compress``), declared and checked there
once, and apply to central and region alike; ``redis_options`` turns them into
one ``RedisOptions`` per server. Three keep the regional tier's own defaults:
``key_prefix`` is ``tc:`` (the Redis tier's is ``tiercache:``: changing it
would orphan the values already stored), and ``timeout_s`` and
``connect_timeout_s`` are 0.5 s. The old ``socket_timeout_ms`` is still
accepted (a ``DeprecationWarning``, logged once). Shutdown: ``close`` gives
queued replications ``close_flush_ms``, then the background tasks (replication
workers, invalidator) ``close_timeout_ms`` to stop and the connections
``close_timeout_ms`` to close; whatever is left is abandoned with a log line,
so ``close`` never hangs on a remote. Retention: ``central_ttl_s`` gives
central's values and version keys a TTL; without it central should have an
``allkeys-*`` policy, else a full central refuses commits and the tier removes
the oldest values itself to make room (checked and logged at start, see
``retention`` and ``room``).
"""

from __future__ import annotations

import enum
import logging
import warnings
from dataclasses import dataclass

from tiercache.common.fields import (
    MAX_RETRIES,
    FieldError,
    int_in_range,
    positive_timeout_ms,
    queue_size,
    worker_count,
)
from tiercache.common.units import MS_PER_SECOND
from tiercache.tiers.redis.options import RedisOptions, RedisServerOptions, redis_url

log = logging.getLogger(__name__)
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
    """Where engines read and write (docs/architecture.md, "Central and regional sync")."""

    CENTRAL = "central"
    """Read and write the central store directly."""
    REGIONAL = "regional"
    """Read and write the region; replicate writes to central; read through on a miss."""


@dataclass(frozen=True, kw_only=True)
class RegionalOptions(RedisServerOptions):
    """The YAML ``options`` of a ``regional`` tier: the Redis tier's shared fields, and these."""

    central_url: str
    region_url: str = ""
    """Required in ``regional`` mode."""
    mode: SyncMode = SyncMode.REGIONAL
    key_prefix: str = "tc:"
    """Not the Redis tier's ``tiercache:``: existing regional data lives under ``tc:``."""
    timeout_s: float = 0.5
    """A socket operation that makes no progress for this long fails (the Redis tier's ``timeout_s``)."""
    connect_timeout_s: float = 0.5
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
    socket_timeout_ms: float | None = None
    """Deprecated: ``timeout_s`` in milliseconds."""
    close_flush_ms: float = 2000.0
    """How long ``close`` lets queued replications finish."""
    close_timeout_ms: float = 1000.0
    """How long ``close`` waits for background tasks, then for connections, to stop before abandoning them."""
    central_ttl_s: float = 0.0
    """TTL of the values and version keys each commit writes at central (0: none); see ``retention``."""

    def __post_init__(self) -> None:
        redis_url("central_url", self.central_url)
        if self.region_url:
            redis_url("region_url", self.region_url)
        if self.socket_timeout_ms is not None:
            positive_timeout_ms("socket_timeout_ms", self.socket_timeout_ms)
            _deprecated("socket_timeout_ms")
            object.__setattr__(self, "timeout_s", self.socket_timeout_ms / MS_PER_SECOND)
            object.__setattr__(self, "connect_timeout_s", self.socket_timeout_ms / MS_PER_SECOND)
        super().__post_init__()
        worker_count("replication_workers", self.replication_workers)
        queue_size("replication_queue_blocks", self.replication_queue_blocks)
        queue_size("replication_batch_blocks", self.replication_batch_blocks)
        int_in_range("replication_retries", self.replication_retries, 0, MAX_RETRIES)
        for name in ("retry_backoff_ms", "close_flush_ms", "close_timeout_ms"):
            positive_timeout_ms(name, getattr(self, name))
        if self.mode is SyncMode.REGIONAL and not self.region_url:
            raise FieldError("region_url", "a Redis URL: it is required in regional mode", self.region_url)
        if self.central_ttl_s < 0:
            raise FieldError("central_ttl_s", "a number >= 0 (0: no TTL)", self.central_ttl_s)

    def redis_options(self, url: str) -> RedisOptions:
        """The Redis tier's options for the data path to the server at ``url`` (central or region)."""
        return RedisOptions(url=url, **self.server_options())
