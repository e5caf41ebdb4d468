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
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from urllib.parse import urlparse, urlunparse

from tiercache.tiers.redis.options import RedisOptions

log = logging.getLogger(__name__)

EVENT_FLAGS = "Exe"
"""Key-event notifications (E) of expired (x) and evicted (e) keys."""
EVENTS = ("evicted", "expired")
POLL_S = 0.5
"""Longest one wait for a notification lasts before the loop checks whether it is stopping."""
MAX_REPORT_KEYS = 1024
"""Notifications gathered into one report at most."""
RESUBSCRIBE_MAX_S = 2.0
"""Longest pause between attempts to subscribe again after the connection was lost."""


class EvictionWatcher:
    """Subscribes to each node's eviction and expiry notifications and reports this tier's block keys."""

    def __init__(
        self,
        name: str,
        options: RedisOptions,
        nodes: Sequence[tuple[str, int]],
        prefix: bytes,
        report: Callable[[list[bytes]], None],
        counts: Counter,
    ) -> None:
        self.name = name
        self.options = options
        self.nodes = list(nodes)
        self.prefix = prefix
        self.report = report
        self.counts = counts
        self.subscribed = 0
        """Nodes whose notifications are being heard now."""
        self._stopping = False
        self._refused_logged = False
        self._tasks: list[asyncio.Task] = []
        self._ready: list[asyncio.Event] = []

    async def start(self, timeout_s: float) -> None:
        """Start watching every node; wait up to ``timeout_s`` until each is subscribed (or gave up)."""
        loop = asyncio.get_running_loop()
        for host, port in self.nodes:
            ready = asyncio.Event()
            self._ready.append(ready)
            watch = self._watch(host, port, ready)
            self._tasks.append(loop.create_task(watch, name=f"tiercache-{self.name}-evictions"))
        if self._ready:
            await asyncio.wait([loop.create_task(ready.wait()) for ready in self._ready], timeout=timeout_s)

    async def close(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def block_key(self, redis_key: object) -> bytes | None:
        """The block key behind a notified Redis key of this tier's prefix (None for anything else)."""
        if not isinstance(redis_key, bytes) or not redis_key.startswith(self.prefix):
            return None
        try:
            return binascii.unhexlify(redis_key[len(self.prefix) :])
        except (binascii.Error, ValueError):
            return None

    async def _watch(self, host: str, port: int, ready: asyncio.Event) -> None:
        from tiercache.tiers.redis.control import connect  # redis-py: imported only when a watcher starts

        options = _node_options(self.options, host, port)
        db = 0 if self.options.cluster else _database(self.options.url)
        channels = [f"__keyevent@{db}__:{event}" for event in EVENTS]
        pause = POLL_S / 10
        while not self._stopping:
            client = connect(options)
            try:
                if not await self._enable(client, host, port):
                    return
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(*channels)
                    self.subscribed += 1
                    ready.set()
                    pause = POLL_S / 10
                    try:
                        await self._listen(pubsub)
                    finally:
                        self.subscribed -= 1
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.counts["eviction_watch_errors"] += 1
                log.debug("redis tier %s: eviction notifications from %s:%d lost: %s", self.name, host, port, error)
            finally:
                ready.set()
                with contextlib.suppress(Exception):
                    await client.aclose()
            if not self._stopping:
                await asyncio.sleep(pause)
                pause = min(pause * 2, RESUBSCRIBE_MAX_S)

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

    async def _listen(self, pubsub: object) -> None:
        """Report notified keys, gathering those already arrived into one report."""
        while not self._stopping:
            message = await pubsub.get_message(timeout=POLL_S)  # type: ignore[attr-defined]
            keys: list[bytes] = []
            while message is not None:
                key = self.block_key(message.get("data"))
                if key is not None:
                    keys.append(key)
                if len(keys) >= MAX_REPORT_KEYS:
                    break
                message = await pubsub.get_message(timeout=0)  # type: ignore[attr-defined]
            if keys:
                self.counts["evictions_reported"] += len(keys)
                self.report(keys)


def _node_options(options: RedisOptions, host: str, port: int) -> RedisOptions:
    """``options`` aimed at one node (its credentials and TLS kept)."""
    parsed = urlparse(options.url)
    userinfo = parsed.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return dataclasses.replace(options, url=urlunparse(parsed._replace(netloc=netloc)), cluster=False)


def _database(url: str) -> int:
    path = urlparse(url).path.lstrip("/")
    return int(path) if path.isdigit() else 0
