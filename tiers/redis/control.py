"""A redis-py client for a Redis tier's control plane: CONFIG, pub/sub and Lua scripts.

The data path has its own RESP client (``pipelined``, ``node``); commands it does
not speak go through redis-py, to the same server with the same credentials and
TLS (``Endpoint``), and without client-side retries, so a failure reaches the
caller at once (a miss upstream). The Redis tier's eviction watcher and the
regional tier's control plane both use it.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tiercache.tiers.redis.node import Endpoint
from tiercache.tiers.redis.options import RedisOptions


def connect(options: RedisOptions) -> aioredis.Redis:
    """A control-plane client of the data path's server, credentials and TLS (``Endpoint``) that fails
    fast (no client-side retries): failures become misses upstream."""
    endpoint = Endpoint.of(options)
    tls = endpoint.tls_context is not None
    extra = {}
    if tls:
        extra = {
            "ssl_ca_certs": options.ssl_ca,
            "ssl_certfile": options.ssl_cert,
            "ssl_keyfile": options.ssl_key,
            "ssl_cert_reqs": "required" if options.ssl_verify else "none",
            "ssl_check_hostname": options.ssl_verify,
        }
    return aioredis.Redis.from_url(
        f"{'rediss' if tls else 'redis'}://{endpoint.host}:{endpoint.port}/{endpoint.db}",
        username=endpoint.username,
        password=endpoint.password,
        socket_timeout=options.timeout_s,
        socket_connect_timeout=options.connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        **extra,
    )
