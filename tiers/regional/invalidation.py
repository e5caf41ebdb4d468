"""Invalidation of stale regional copies from central's update channel.

Central publishes ``key + version`` for every commit; a region that hears it drops
its copy if older, so plain regional reads see new values early. force_latest
reads do not depend on it (they check central's versions themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from tiercache.tiers.regional.stores import RegionStore
from tiercache.tiers.regional.versions import U64
from tiercache.tiers.shutdown import stop_tasks

log = logging.getLogger(__name__)
KEY_BYTES = 16
"""Length of a block key in an update message (followed by the u64 version)."""
RESUBSCRIBE_MAX_S = 1.0
"""Longest pause between attempts to re-subscribe to central's updates."""
SUBSCRIBE_POLL_S = 0.5
"""How long one wait for a message lasts before the loop looks around again."""


class Invalidator:
    """Subscribes to central's update channel and drops older regional copies.

    Reconnects with back-off while central is down (each failure goes to
    ``on_error``, which names its cause); updates published meanwhile
    are missed, which only delays plain reads (force_latest checks versions).
    ``close`` is bounded: the loop checks a stop flag at every message or poll
    and is cancelled through ``shutdown.stop_tasks``.
    """

    def __init__(
        self,
        connect: Callable[[], aioredis.Redis],
        channel: str,
        region: RegionStore,
        on_error: Callable[[BaseException], object],
    ) -> None:
        self.connect = connect
        self.on_error = on_error
        self.channel = channel
        self.region = region
        self.received = 0
        self.dropped = 0
        self.subscribed = asyncio.Event()
        self._stopping = False
        self.task = asyncio.get_running_loop().create_task(self._run(), name="tiercache-invalidator")

    async def close(self, deadline_s: float) -> int:
        """Stop listening within ``deadline_s``; 1 if the task had to be abandoned, else 0."""
        self._stopping = True
        return await stop_tasks([self.task], grace_s=0.0, cancel_s=deadline_s, what="invalidator")

    async def _run(self) -> None:
        pause = SUBSCRIBE_POLL_S / 10
        while not self._stopping:
            client = self.connect()
            try:
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.subscribed.set()
                    pause = SUBSCRIBE_POLL_S / 10
                    while not self._stopping:
                        message = await pubsub.get_message(timeout=SUBSCRIBE_POLL_S)
                        if message is not None:
                            await self._handle(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.on_error(error)
                log.debug("update channel lost; re-subscribing", exc_info=True)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await client.aclose()
            if not self._stopping:
                await asyncio.sleep(pause)
                pause = min(pause * 2, RESUBSCRIBE_MAX_S)

    async def _handle(self, data: object) -> None:
        if not isinstance(data, bytes) or len(data) != KEY_BYTES + U64.size:
            return
        key, version = data[:KEY_BYTES], U64.unpack_from(data, KEY_BYTES)[0]
        self.received += 1
        if await self.region.drop_older(key, version):
            self.dropped += 1
