"""Central plus two regions on real redis-servers, and the helpers of the sync tests.

A ``Topology`` is central, region A and region B, and a factory of regional
tiers over them (the ``sites`` fixture in ``conftest`` closes them after the
test); ``read`` returns what a tier
serves per key (None for a miss); ``eventually`` polls a condition for background
work (a hang detector, never a timing assertion); ``hold_writes`` makes a server
hold every write while it still answers reads, so a region's replication waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tiercache.blocks.codec import Codec
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier, SyncMode

BLOCK_BYTES = 256
FINGERPRINT = bytes(range(16, 32))
WAIT_STEP_S = 0.005
WAIT_STEPS = 2000
"""``eventually`` gives background work up to 10 s before failing (never a timing assertion)."""
FAST_RETRIES = {"replication_retries": 2, "retry_backoff_ms": 5.0, "timeout_s": 0.3, "connect_timeout_s": 0.3}
HOLD_MS = 60_000
"""How long ``hold_writes`` holds at most (``release_writes`` ends it sooner)."""
PATIENT = {"timeout_s": HOLD_MS / 1000}
"""Options of a tier whose replication must wait out held writes rather than time out and retry."""


async def eventually(condition: Callable[[], Any]) -> None:
    for _ in range(WAIT_STEPS):
        if await condition():
            return
        await asyncio.sleep(WAIT_STEP_S)
    raise AssertionError("condition not reached")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(tag: int) -> memoryview:
    return memoryview(bytes([tag % 256]) * BLOCK_BYTES)


def buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(BLOCK_BYTES)) for _ in range(count)]


def hold_writes(server: RedisServer) -> None:
    """The server holds every write command until ``release_writes`` (``CLIENT PAUSE ... WRITE``, as a
    failover does) and goes on answering reads: a region's replication to it waits, its versions stay."""
    server.cli("CLIENT", "PAUSE", str(HOLD_MS), "WRITE")


def release_writes(server: RedisServer) -> None:
    """The writes ``hold_writes`` held go through."""
    server.cli("CLIENT", "UNPAUSE")


class Topology:
    """Central plus two regions, and a tier factory over them."""

    def __init__(self, factory: Callable[..., RedisServer]) -> None:
        self.central, self.region_a, self.region_b = factory(), factory(), factory()
        self.tiers: list[RegionalTier] = []

    async def tier(self, region: RedisServer | None, codec: Codec | None = None, **options: Any) -> RegionalTier:
        mode = SyncMode.REGIONAL if region is not None else SyncMode.CENTRAL
        opts = RegionalOptions(
            central_url=self.central.url, region_url=region.url if region else "", mode=mode, **options
        )
        listening = self.central.subscribers(opts.channel)
        tier = RegionalTier(RemoteContext("regional", codec or Codec(FINGERPRINT), BLOCK_BYTES), opts)
        await tier.start()
        if tier.invalidator is not None:  # until central counts its subscription to the updates
            await eventually(lambda: holds(self.central.subscribers(opts.channel) > listening))
        self.tiers.append(tier)
        return tier


async def holds(value: bool) -> bool:
    """``value``, as a condition ``eventually`` can await."""
    return value


async def read(tier: RegionalTier, keys: list[bytes], *, force_latest: bool = False) -> list[bytes | None]:
    dests = buffers(len(keys))
    oks = await tier.get_into(keys, dests, force_latest=force_latest)
    return [bytes(d) if ok else None for d, ok in zip(dests, oks, strict=True)]
