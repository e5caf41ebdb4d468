"""A regional tier's Redis connections: fail-fast clients behind a circuit breaker.

Central and region are each reached, for the control plane (Lua scripts,
pub/sub, CONFIG; the data path is ``plane``), through one ``GuardedClient``: a
redis-py asyncio client without client-side retries (``tiers/redis/control.py``: a
failure becomes a miss upstream at once), a ``CircuitBreaker`` so that, once a
server is found dead, calls fail immediately instead of each waiting for its
socket timeout, and a ``Diagnosis`` that names, counts and logs why calls fail
(auth, ACL, OOM, unreachable).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tiercache.common.breaker import BreakerState, CircuitBreaker
from tiercache.tiers.regional.diagnosis import Diagnosis

T = TypeVar("T")


class GuardedClient:
    """A Redis client behind a circuit breaker.

    Once a server is found dead, calls fail at once (misses upstream) instead of
    each waiting for its socket timeout; after a back-off one trial call goes through,
    and a server that answers again is used again without a restart.
    """

    def __init__(self, client: aioredis.Redis, breaker: CircuitBreaker, diagnosis: Diagnosis) -> None:
        self.client = client
        self.breaker = breaker
        self.diagnosis = diagnosis

    async def call(self, operation: Callable[[aioredis.Redis], Awaitable[T]], failed: T, what: str = "call") -> T:
        """``operation(client)``, or ``failed`` when the breaker refuses or the server fails (cause recorded)."""
        if not self.breaker.allow():
            return failed
        try:
            result = await operation(self.client)
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except (RedisError, OSError) as error:
            self.breaker.failure()
            self.diagnosis.record(error, what)
            return failed
        self.breaker.success()
        return result

    def check_replies(self, replies: list[object] | None, what: str) -> None:
        """Record the cause of every failed command in a pipeline's ``replies``."""
        for reply in replies or []:
            if isinstance(reply, Exception):
                self.diagnosis.record(reply, what)

    def stats(self, prefix: str) -> dict[str, float]:
        """The breaker's state and counters (``{prefix}_breaker_*``) and the failure causes (``{role}_errors_*``)."""
        breaker = self.breaker
        return {
            f"{prefix}_breaker_state": float(breaker.state),
            f"{prefix}_breaker_open": float(breaker.state is not BreakerState.CLOSED),
            f"{prefix}_breaker_opened": float(breaker.opened),
            f"{prefix}_breaker_rejected": float(breaker.rejected),
            **self.diagnosis.stats(),
        }

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()


async def pipelined(client: aioredis.Redis, queue: Callable[[object], None]) -> list[object]:
    """Run the commands ``queue(pipe)`` adds in one non-transactional pipeline; errors stay in the list."""
    async with client.pipeline(transaction=False) as pipe:
        queue(pipe)
        return await pipe.execute(raise_on_error=False)
