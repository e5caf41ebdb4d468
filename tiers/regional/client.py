"""A regional tier's Redis connections: fail-fast clients behind a circuit breaker.

Central and region are each reached through one ``GuardedClient``: a redis-py
asyncio client without client-side retries (a failure becomes a miss upstream at
once) and a ``CircuitBreaker`` so that, once a server is found dead, calls fail
immediately instead of each waiting for its socket timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tiercache.breaker import BreakerState, CircuitBreaker

T = TypeVar("T")


def connect(url: str, timeout_s: float) -> aioredis.Redis:
    """A client that fails fast (no client-side retries): failures become misses upstream."""
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


class GuardedClient:
    """A Redis client behind a circuit breaker.

    Once a server is found dead, calls fail at once (misses upstream) instead of
    each waiting for its socket timeout; after a back-off one probe goes through,
    and a server that answers again is used again without a restart.
    """

    def __init__(self, client: aioredis.Redis, breaker: CircuitBreaker) -> None:
        self.client = client
        self.breaker = breaker

    async def call(self, operation: Callable[[aioredis.Redis], Awaitable[T]], failed: T) -> T:
        """``operation(client)``, or ``failed`` when the breaker refuses or the server fails."""
        if not self.breaker.allow():
            return failed
        try:
            result = await operation(self.client)
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except (RedisError, OSError):
            self.breaker.failure()
            return failed
        self.breaker.success()
        return result

    def stats(self, prefix: str) -> dict[str, float]:
        """The breaker's state and counters, named ``{prefix}_breaker_*``."""
        breaker = self.breaker
        return {
            f"{prefix}_breaker_state": float(breaker.state),
            f"{prefix}_breaker_open": float(breaker.state is not BreakerState.CLOSED),
            f"{prefix}_breaker_opened": float(breaker.opened),
            f"{prefix}_breaker_rejected": float(breaker.rejected),
        }

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()


async def pipelined(client: aioredis.Redis, queue: Callable[[object], None]) -> list[object]:
    """Run the commands ``queue(pipe)`` adds in one non-transactional pipeline; errors stay in the list."""
    async with client.pipeline(transaction=False) as pipe:
        queue(pipe)
        return await pipe.execute(raise_on_error=False)
