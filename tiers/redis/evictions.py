"""Evictions and expiries a Redis server makes by itself, heard through keyspace notifications.

A server evicts keys under ``maxmemory`` and expires them after ``ttl_s`` without
telling its clients. With ``notify-keyspace-events`` holding ``E`` (key-event
channels), ``x`` (expired) and ``e`` (evicted), it publishes each such key on
``__keyevent@<db>__:expired`` and ``__keyevent@<db>__:evicted``. The watcher adds
those flags with ``CONFIG SET`` (keeping the ones already set), subscribes on every
node (each cluster node publishes its own keys), and reports the block keys of
this tier's prefix to the tier's listeners (``RemoteTier.report_evicted``).

Best effort by nature: Redis pub/sub does not keep messages for a subscriber that
is reconnecting, and a server that refuses ``CONFIG SET`` (a managed service, an
ACL) cannot be asked to publish; that is logged once and counted
(``eviction_watch_refused``), and the tier's view for routers is then best effort.
"""

from __future__ import annotations

import asyncio
import binascii
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from urllib.parse import urlparse, urlunparse

from tiercache.tiers.redis.options import RedisOptions
from tiercache.tiers.redis.subscription import Subscription

log = logging.getLogger(__name__)

EVENT_FLAGS = "Exe"
"""Key-event notifications (E) of expired (x) and evicted (e) keys."""
EVENTS = ("evicted", "expired")
RESUBSCRIBE_MAX_S = 2.0
"""Longest pause between attempts to subscribe again after the connection was lost."""
CLOSE_S = 1.0
"""How long ``close`` waits for the subscriptions to stop before abandoning them."""


class EvictionWatcher:
    """Subscribes to each node's eviction and expiry notifications and reports this tier's block keys."""

    def __init__(
        self,
        name: str,
        options: RedisOptions,
        nodes: Sequence[tuple[str, int]],
        prefix: bytes,
        db: int,
        report: Callable[[list[bytes]], None],
        counts: Counter,
    ) -> None:
        self.name = name
        self.db = 0 if options.cluster else db
        """The database whose key events are heard (a cluster has only database 0)."""
        self.options = options
        self.nodes = list(nodes)
        self.prefix = prefix
        self.report = report
        self.counts = counts
        self._refused_logged = False
        self._subscriptions: list[Subscription] = []

    async def start(self, timeout_s: float) -> None:
        """Start watching every node; wait up to ``timeout_s`` until each is subscribed (or gave up)."""
        from tiercache.tiers.redis.control import connect  # redis-py: imported only when a watcher starts

        channels = [f"__keyevent@{self.db}__:{event}" for event in EVENTS]
        for host, port in self.nodes:
            options = _node_options(self.options, host, port)

            async def enable(client: object, host: str = host, port: int = port) -> bool:
                return await self._enable(client, host, port)

            self._subscriptions.append(
                Subscription(
                    f"{self.name}-evictions-{host}:{port}",
                    lambda options=options: connect(options),
                    channels,
                    self._report,
                    max_pause_s=RESUBSCRIBE_MAX_S,
                    on_lost=self._lost,
                    prepare=enable,
                )
            )
        if self._subscriptions:
            loop = asyncio.get_running_loop()
            waits = [loop.create_task(subscription.settled.wait()) for subscription in self._subscriptions]
            _, pending = await asyncio.wait(waits, timeout=timeout_s)
            for wait in pending:
                wait.cancel()

    async def close(self) -> None:
        """Stop every subscription, bounded by ``CLOSE_S``."""
        await asyncio.gather(*(subscription.close(CLOSE_S) for subscription in self._subscriptions))

    def block_key(self, redis_key: object) -> bytes | None:
        """The block key behind a notified Redis key of this tier's prefix (None for anything else)."""
        if not isinstance(redis_key, bytes) or not redis_key.startswith(self.prefix):
            return None
        try:
            return binascii.unhexlify(redis_key[len(self.prefix) :])
        except (binascii.Error, ValueError):
            return None

    async def _report(self, notified: list[object]) -> None:
        keys = [key for key in map(self.block_key, notified) if key is not None]
        if keys:
            self.counts["evictions_reported"] += len(keys)
            self.report(keys)

    def _lost(self, error: BaseException) -> None:
        """Count a lost subscription (the subscription logs it and subscribes again)."""
        self.counts["eviction_watch_errors"] += 1

    async def _enable(self, client: object, host: str, port: int) -> bool:
        """Add ``EVENT_FLAGS`` to the server's notification flags; False (logged once) when it refuses."""
        from redis.exceptions import ResponseError

        try:
            current = (await client.config_get("notify-keyspace-events")).get("notify-keyspace-events", "")  # type: ignore[attr-defined]
            wanted = "".join(sorted(set(current) | set(EVENT_FLAGS)))
            if set(wanted) != set(current):
                await client.config_set("notify-keyspace-events", wanted)  # type: ignore[attr-defined]
        except ResponseError as error:
            self.counts["eviction_watch_refused"] += 1
            if not self._refused_logged:
                self._refused_logged = True
                log.warning(
                    "redis tier %s: %s:%d refuses CONFIG notify-keyspace-events (%s); its own evictions and "
                    "expiries are not reported, so routers' view of this tier is best effort", self.name, host, port,
                    error,
                )
            return False
        return True


def _node_options(options: RedisOptions, host: str, port: int) -> RedisOptions:
    """``options`` aimed at one node (its credentials and TLS kept)."""
    parsed = urlparse(options.url)
    userinfo = parsed.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return dataclasses.replace(options, url=urlunparse(parsed._replace(netloc=netloc)), cluster=False)

