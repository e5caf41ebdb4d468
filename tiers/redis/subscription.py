"""Subscription: a Redis pub/sub subscription that a background task keeps alive across lost connections.

The task connects, lets its owner prepare the server (``prepare``: False gives up
for good, as when a server refuses to publish), subscribes and hands each batch of
arrived messages' data to ``on_messages``; a lost connection goes to ``on_lost``
and is retried after a pause that doubles up to ``max_pause_s``. Pub/sub keeps
nothing for a subscriber that is away, so every user of it is best effort by nature.
``close`` is bounded (``shutdown.stop_tasks``): the loop also checks a stop flag at
every poll, so a cancel that redis-py swallows only delays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tiercache.tiers.shutdown import stop_tasks

log = logging.getLogger(__name__)

POLL_S = 0.5
"""Longest one wait for a message lasts before the loop checks whether it is stopping."""
MAX_BATCH = 1024
"""Messages handed to ``on_messages`` at once at most."""


class Subscription:
    """One pub/sub subscription, kept by a background task; ``settled`` is set once its first attempt ended."""

    def __init__(
        self,
        name: str,
        connect: Callable[[], Any],
        channels: Sequence[str],
        on_messages: Callable[[list[object]], Awaitable[None]],
        *,
        max_pause_s: float,
        on_lost: Callable[[BaseException], object] = lambda error: None,
        prepare: Callable[[Any], Awaitable[bool]] | None = None,
    ) -> None:
        self.name = name
        self.connect = connect
        self.channels = list(channels)
        self.on_messages = on_messages
        self.on_lost = on_lost
        self.prepare = prepare
        self.max_pause_s = max_pause_s
        self.settled = asyncio.Event()
        """Set once the first attempt ended: subscribed, failed or given up."""
        self._stopping = False
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"tiercache-{name}")

    async def close(self, deadline_s: float) -> int:
        """Stop within ``deadline_s``; 1 if the task had to be abandoned, else 0."""
        self._stopping = True
        return await stop_tasks([self.task], grace_s=0.0, cancel_s=deadline_s, what=self.name)

    async def _run(self) -> None:
        pause = POLL_S / 10
        while not self._stopping:
            client = self.connect()
            try:
                if self.prepare is not None and not await self.prepare(client):
                    return
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(*self.channels)
                    self.settled.set()
                    pause = POLL_S / 10
                    await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.on_lost(error)
                log.debug("%s: subscription lost; subscribing again", self.name, exc_info=True)
            finally:
                self.settled.set()
                with contextlib.suppress(Exception):
                    await client.aclose()
            if not self._stopping:
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.max_pause_s)

    async def _listen(self, pubsub: Any) -> None:
        """Hand over messages, gathering those already arrived into one batch."""
        while not self._stopping:
            message = await pubsub.get_message(timeout=POLL_S)
            batch: list[object] = []
            while message is not None:
                batch.append(message.get("data"))
                if len(batch) >= MAX_BATCH:
                    break
                message = await pubsub.get_message(timeout=0)
            if batch:
                await self.on_messages(batch)
