"""The ``options`` of a ``type: redis`` tier."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RedisOptions:
    """The ``options`` of a ``type: redis`` tier.

    ``url``: ``redis://[user:password@]host:port[/db]`` (``rediss://`` = TLS); for a
    cluster, any one node. ``key_prefix`` namespaces the Redis keys. ``compress``:
    lz4 per value when it helps. ``ttl_s``: expire entries. ``timeout_s``: a
    socket operation that makes no progress for this long fails (frozen server).
    ``connections``: sockets (and worker threads) per node. ``pipeline_bytes``:
    requests in flight per socket, in value bytes. ``stage_reads``: validate a
    value completely before copying any of it into the destination.
    ``allow_unbounded``: write even when the server has no ``maxmemory``.
    ``breaker_*``: consecutive failures before a node is skipped, first and
    longest back-off.
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
    connections: int = 2
    pipeline_bytes: int = 4 << 20
    stage_reads: bool = False
    allow_unbounded: bool = False
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        parsed = urlparse(self.url)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ValueError(f"url must be redis://host:port or rediss://host:port, got {self.url!r}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive")
        if self.connections < 1 or self.pipeline_bytes < 1 or self.breaker_failures < 1:
            raise ValueError("connections, pipeline_bytes and breaker_failures must be >= 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive (or null for no expiry)")
        if not 0 < self.breaker_backoff_s <= self.breaker_backoff_max_s:
            raise ValueError("need 0 < breaker_backoff_s <= breaker_backoff_max_s")
