"""Invalidation of stale regional copies from central's update channel.

Central publishes ``key + version`` for every commit; a region that hears it drops
its copy if older, so plain regional reads see new values early. force_latest
reads do not depend on it (they check central's versions themselves).
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from tiercache.tiers.redis.subscription import Subscription
from tiercache.tiers.regional.stores import RegionStore
from tiercache.tiers.regional.versions import U64

KEY_BYTES = 16
"""Length of a block key in an update message (followed by the u64 version)."""
RESUBSCRIBE_MAX_S = 1.0
"""Longest pause between attempts to re-subscribe to central's updates."""


class Invalidator:
    """Subscribes to central's update channel and drops older regional copies.

    Reconnects with back-off while central is down (each failure goes to
    ``on_error``, which names its cause); updates published meanwhile
    are missed, which only delays plain reads (force_latest checks versions).
    ``close`` is bounded (``subscription.Subscription``).
    """

    def __init__(
        self,
        connect: Callable[[], aioredis.Redis],
        channel: str,
        region: RegionStore,
        on_error: Callable[[BaseException], object],
    ) -> None:
        self.region = region
        self.received = 0
        self.dropped = 0
        self._subscription = Subscription(
            "invalidator", connect, [channel], self._drop_older, max_pause_s=RESUBSCRIBE_MAX_S, on_lost=on_error
        )

    async def close(self, deadline_s: float) -> int:
        """Stop listening within ``deadline_s``; 1 if the task had to be abandoned, else 0."""
        return await self._subscription.close(deadline_s)

    async def _drop_older(self, messages: list[object]) -> None:
        """Drop each regional copy older than the version an update names (anything else is ignored)."""
        for data in messages:
            if not isinstance(data, bytes) or len(data) != KEY_BYTES + U64.size:
                continue
            key, version = data[:KEY_BYTES], U64.unpack_from(data, KEY_BYTES)[0]
            self.received += 1
            if await self.region.drop_older(key, version):
                self.dropped += 1
