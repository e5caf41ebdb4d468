"""The ``options`` of a ``type: redis`` tier, the fields every tier on Redis servers shares, and Redis's rules.

``RedisServerOptions`` holds what a tier needs to talk to Redis servers
(credentials, TLS, timeouts, connections, pipelining, the capacity check, the
breaker, compression, the key prefix); ``RedisOptions`` (``type: redis``) and
the regional tier's ``RegionalOptions`` extend it, so each field is declared and
checked once, with one name and one error message. ``redis_url`` is Redis's URL
rule; it lives here, with the tier, not in the core's checks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlparse

from tiercache.common.fields import (
    MAX_RETRIES,
    FieldError,
    int_in_range,
    number_in_range,
    positive_timeout_s,
    worker_count,
)

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
MAX_REDIS_DB = 1 << 16
"""Largest Redis logical database index accepted (servers default to 16)."""
REDIS_SCHEMES = ("redis", "rediss")
"""URL schemes of a Redis server: plain and TLS."""
TIMEOUT_FIELDS = ("timeout_s", "connect_timeout_s", "breaker_backoff_s", "breaker_backoff_max_s")
"""The shared fields that are durations in seconds."""
MAX_TTL_S = 10 * 365 * 24 * 3600.0
"""Longest ``ttl_s``: ten years (longer is a unit mistake)."""


def redis_url(field: str, value: Any) -> str:
    """``redis://[user:password@]host[:port][/db]`` (``rediss://`` for TLS), every part well formed."""
    expected = "a URL redis://[user:password@]host[:port][/db] (or rediss://) with port 1-65535 and an integer db"
    if not isinstance(value, str):
        raise FieldError(field, expected, value)
    try:
        parsed = urlparse(value)
        port = parsed.port
    except ValueError:
        raise FieldError(field, expected, value) from None
    if parsed.scheme not in REDIS_SCHEMES or not parsed.hostname or port == 0:
        raise FieldError(field, expected, value)
    db = parsed.path.strip("/")
    if db and not (db.isdigit() and int(db) <= MAX_REDIS_DB):
        raise FieldError(field, expected, value)
    if parsed.query or parsed.fragment or parsed.params:
        raise FieldError(field, expected + " and no query string", value)
    return value


@dataclass(frozen=True)
class RedisServerOptions:
    """What every tier on Redis servers shares (``RedisOptions``, ``RegionalOptions``).

    ``key_prefix`` namespaces the Redis keys. ``username``/``password`` override
    the URL's. ``ssl`` (also implied by ``rediss://``), ``ssl_ca``, ``ssl_cert``,
    ``ssl_key``, ``ssl_verify``: TLS. ``compress``: lz4 per value when it helps.
    ``timeout_s``: a socket operation that makes no progress for this long fails
    (frozen server); ``connect_timeout_s`` likewise for connecting.
    ``connections``: sockets (each driven by its own I/O thread) per server; null
    (the default) picks by value size: 1 below 1 MiB, 2 from there.
    ``pipeline_bytes``: requests in flight per socket, in value bytes (at most
    ``MAX_IN_FLIGHT`` requests, at least one). ``stage_reads``: validate a value
    completely before copying any of it into the destination.
    ``allow_unbounded``: write even when the server has no ``maxmemory``.
    ``breaker_*``: consecutive failures before a server is skipped, first and
    longest back-off: for a ``redis`` tier, of its one breaker (its transfer
    lane's; a cluster's nodes each keep one too), for the regional tier, of
    region's and central's.
    """

    key_prefix: str = "tiercache:"
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None
    ssl_verify: bool = True
    compress: bool = False
    timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    connections: int | None = None
    pipeline_bytes: int = 6 << 20
    stage_reads: bool = False
    allow_unbounded: bool = False
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.connections is not None:
            worker_count("connections", self.connections)
        int_in_range("pipeline_bytes", self.pipeline_bytes, 1, MAX_PIPELINE_BYTES)
        int_in_range("breaker_failures", self.breaker_failures, 1, MAX_RETRIES)
        for name in TIMEOUT_FIELDS:
            positive_timeout_s(name, getattr(self, name))
        if self.breaker_backoff_s > self.breaker_backoff_max_s:
            expected = f"at least breaker_backoff_s ({self.breaker_backoff_s})"
            raise FieldError("breaker_backoff_max_s", expected, self.breaker_backoff_max_s)

    def server_options(self) -> dict[str, Any]:
        """The shared fields and their values (to build a ``RedisOptions`` from a subclass's)."""
        return {field.name: getattr(self, field.name) for field in fields(RedisServerOptions)}

    def connections_for(self, block_bytes: int) -> int:
        """Connections per server for blocks of ``block_bytes`` (``connections``, or by value size)."""
        if self.connections is not None:
            return self.connections
        return DEFAULT_CONNECTIONS[block_bytes >= LARGE_VALUE_BYTES]

    def window_for(self, block_bytes: int) -> int:
        """Requests in flight per connection for blocks of ``block_bytes``."""
        return max(1, min(MAX_IN_FLIGHT, self.pipeline_bytes // block_bytes))


@dataclass(frozen=True)
class RedisOptions(RedisServerOptions):
    """The ``options`` of a ``type: redis`` tier: the shared fields (``RedisServerOptions``), and

    ``url``: ``redis://[user:password@]host:port[/db]`` (``rediss://`` = TLS); for a
    cluster, any one node. ``cluster``: route keys by the cluster's slot map.
    ``ttl_s``: expire entries (null: never). ``notify_evictions``: hear the
    server's own evictions and expiries through keyspace notifications (adds
    ``Exe`` to its ``notify-keyspace-events`` with ``CONFIG SET``), so routers
    are told of them (``evictions.py``).
    """

    url: str = f"redis://127.0.0.1:{DEFAULT_PORT}"
    cluster: bool = False
    ttl_s: float | None = None
    notify_evictions: bool = True

    def __post_init__(self) -> None:
        redis_url("url", self.url)
        super().__post_init__()
        if self.ttl_s is not None:
            number_in_range("ttl_s", self.ttl_s, 0.0, MAX_TTL_S, low_open=True)
