"""The ``options`` of a ``type: redis`` tier."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from tiercache.config.validate import MAX_RETRIES, int_in_range, positive_timeout_s, redis_url, worker_count

DEFAULT_PORT = 6379
MAX_IN_FLIGHT = 32
"""Requests in flight per connection at most (whatever ``pipeline_bytes`` allows)."""
LARGE_VALUE_BYTES = 1 << 20
"""From this block size on, two connections per node by default (the client's copy and checksum
of a MiB-sized value then overlap with the server's work on another)."""
DEFAULT_CONNECTIONS = {False: 1, True: 2}
"""Connections per node by default, keyed by ``block_bytes >= LARGE_VALUE_BYTES``."""



MAX_PIPELINE_BYTES = 1 << 30
"""Bytes of requests one connection may have in flight, at most (1 GiB)."""

@dataclass(frozen=True)
class RedisOptions:
    """The ``options`` of a ``type: redis`` tier.

    ``url``: ``redis://[user:password@]host:port[/db]`` (``rediss://`` = TLS); for a
    cluster, any one node. ``key_prefix`` namespaces the Redis keys. ``compress``:
    lz4 per value when it helps. ``ttl_s``: expire entries. ``timeout_s``: a
    socket operation that makes no progress for this long fails (frozen server).
    ``connections``: sockets (each driven by its own I/O thread) per node; null
    (the default) picks by value size: 1 below 1 MiB, 2 from there.
    ``pipeline_bytes``: requests in flight per socket, in value bytes (at most
    ``MAX_IN_FLIGHT`` requests, at least one). ``stage_reads``: validate a
    value completely before copying any of it into the destination.
    ``allow_unbounded``: write even when the server has no ``maxmemory``.
    ``breaker_*``: consecutive failures before a node is skipped, first and
    longest back-off. ``notify_evictions``: hear the server's own evictions and
    expiries through keyspace notifications (adds ``Exe`` to its
    ``notify-keyspace-events`` with ``CONFIG SET``), so routers are told of them.
    """

    url: str = f"redis://127.0.0.1:{DEFAULT_PORT}"
    cluster: bool = False
    key_prefix: str = "tiercache:"
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None
    ssl_verify: bool = True
    compress: bool = False
    ttl_s: float | None = None
    timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    connections: int | None = None
    pipeline_bytes: int = 6 << 20
    stage_reads: bool = False
    allow_unbounded: bool = False
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0
    notify_evictions: bool = True

    def connections_for(self, block_bytes: int) -> int:
        """Connections per node for blocks of ``block_bytes`` (``connections``, or by value size)."""
        if self.connections is not None:
            return self.connections
        return DEFAULT_CONNECTIONS[block_bytes >= LARGE_VALUE_BYTES]

    def window_for(self, block_bytes: int) -> int:
        """Requests in flight per connection for blocks of ``block_bytes``."""
        return max(1, min(MAX_IN_FLIGHT, self.pipeline_bytes // block_bytes))

    def __post_init__(self) -> None:
        redis_url("url", self.url)
        if self.connections is not None:
            worker_count("connections", self.connections)
        int_in_range("pipeline_bytes", self.pipeline_bytes, 1, MAX_PIPELINE_BYTES)
        int_in_range("breaker_failures", self.breaker_failures, 1, MAX_RETRIES)
        for name in ("timeout_s", "connect_timeout_s", "breaker_backoff_s", "breaker_backoff_max_s"):
            positive_timeout_s(name, getattr(self, name))
        parsed = urlparse(self.url)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ValueError(f"url must be redis://host:port or rediss://host:port, got {self.url!r}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive")
        if (self.connections is not None and self.connections < 1) or self.pipeline_bytes < 1 or (
            self.breaker_failures < 1
        ):
            raise ValueError("connections, pipeline_bytes and breaker_failures must be >= 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive (or null for no expiry)")
        if not 0 < self.breaker_backoff_s <= self.breaker_backoff_max_s:
            raise ValueError("need 0 < breaker_backoff_s <= breaker_backoff_max_s")
