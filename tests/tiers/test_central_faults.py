"""force_latest when central cannot answer, and a central that is full: real redis-servers.

force_latest serves the newest version committed at central when the read
began (and this node's own acknowledged writes) — which only central can tell:
with central unreachable, or its breaker open, every force_latest read is a
miss, this node's unreplicated writes included. A full central that does not
evict (``noeviction``, no ``central_ttl_s``) is survivable: the tier removes the
oldest committed values itself to make room, counted and logged, so
replication and force_latest keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support.sync_sites import (
    FAST_RETRIES,
    FINGERPRINT,
    PATIENT,
    Topology,
    eventually,
    hold_writes,
    key,
    payload,
    read,
)

from tiercache.blocks.codec import Codec
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier, SyncMode

OWN_WRITES = 8
OPEN_FOR_S = 60.0
"""The central breaker's back-off: it stays open for the whole test once tripped."""


async def test_an_open_central_breaker_makes_force_latest_miss_even_own_writes(sites: Topology) -> None:
    a = await sites.tier(
        sites.region_a,
        **{**FAST_RETRIES, **PATIENT},
        invalidate=False,
        breaker_failures=2,
        breaker_backoff_s=OPEN_FOR_S,
        breaker_backoff_max_s=OPEN_FOR_S,
    )
    keys = [key(200 + i) for i in range(OWN_WRITES)]
    written = [bytes(payload(i)) for i in range(OWN_WRITES)]
    hold_writes(sites.central)  # replication waits: the writes stay this node's own, unreplicated
    assert await a.put(keys, [payload(i) for i in range(OWN_WRITES)]) == [True] * OWN_WRITES
    assert await read(a, keys, force_latest=True) == written, "central up: this node reads its own writes"
    sites.central.kill()
    while not a.stats()["central_breaker_open"]:
        assert await read(a, [key(999)], force_latest=True) == [None]
    unavailable = a.stats()["latest_unavailable"]
    assert await read(a, keys, force_latest=True) == [None] * OWN_WRITES, "no latest without central's word"
    assert a.stats()["latest_unavailable"] == unavailable + OWN_WRITES
    assert await read(a, keys) == written, "plain reads still serve the region's copies"


BIG_BLOCK_BYTES = 64 * 1024
SMALL_CENTRAL = "3mb"
"""Room for a few dozen 64 KiB values beside the server's own ~1 MB."""
CENTRAL_TTL_S = 3.0
"""Long enough to see the TTL set, short enough to wait for the expiry."""
ROUNDS = 12
PER_ROUND = 8
"""Central holds about 20 values: full from the third round on, and written over four times in all."""


def big_tier(central: RedisServer, region: RedisServer, **options: Any) -> RegionalTier:
    opts = RegionalOptions(central_url=central.url, region_url=region.url, invalidate=False, **FAST_RETRIES, **options)
    return RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BIG_BLOCK_BYTES), opts)


def big_payload(i: int) -> bytes:
    return bytes([i % 256]) * BIG_BLOCK_BYTES


async def put_big(tier: RegionalTier, first: int, count: int) -> None:
    for i in range(first, first + count):
        assert await tier.put([key(i)], [memoryview(big_payload(i))]) == [True]
    await tier.flush()


async def test_a_full_noeviction_central_is_survived_counted_and_logged(
    redis_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 20 item 4: a full noeviction central stopped replication for good; force_latest then served
    almost nothing. Now the tier frees room at central, and another region's force_latest reads keep
    getting the newest writes."""
    central = redis_factory(maxmemory=SMALL_CENTRAL, maxmemory_policy="noeviction")
    writer = big_tier(central, redis_factory())
    reader = big_tier(central, redis_factory())
    with caplog.at_level("WARNING"):
        await writer.start()
        await reader.start()
        try:
            assert writer.stats()["central_retention_stops"] == 1
            assert any("maxmemory-policy noeviction" in r.getMessage() for r in caplog.records)
            for round_ in range(ROUNDS):
                first = round_ * PER_ROUND
                await put_big(writer, first, PER_ROUND)
                newest = range(first, first + PER_ROUND)
                keys = [key(i) for i in newest]
                dests = [memoryview(bytearray(BIG_BLOCK_BYTES)) for _ in keys]
                served = await reader.get_into(keys, dests, force_latest=True)
                assert all(served), f"round {round_}: {served.count(False)} of {PER_ROUND} newest writes not served"
                assert all(bytes(d) == big_payload(i) for d, i in zip(dests, newest, strict=True))
            stats = writer.stats()
        finally:
            await writer.close()
            await reader.close()
    assert stats["central_errors_oom"] > 0, "central must have been full"
    assert stats["replication_failed"] == 0 and stats["replicated"] == ROUNDS * PER_ROUND
    assert stats["central_freed"] > 0 and stats["central_freed_bytes"] >= stats["central_freed"] * BIG_BLOCK_BYTES
    assert any("failed with OOM" in r.getMessage() for r in caplog.records)
    assert any("to make room" in r.getMessage() for r in caplog.records)


async def test_a_full_central_in_central_mode_takes_writes(redis_factory: Callable[..., RedisServer]) -> None:
    """Engines writing to central directly: a full noeviction central still takes every write."""
    central = redis_factory(maxmemory=SMALL_CENTRAL, maxmemory_policy="noeviction")
    opts = RegionalOptions(central_url=central.url, mode=SyncMode.CENTRAL, invalidate=False, **FAST_RETRIES)
    tier = RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BIG_BLOCK_BYTES), opts)
    await tier.start()
    try:
        for i in range(ROUNDS * PER_ROUND):
            assert await tier.put([key(i)], [memoryview(big_payload(i))]) == [True], f"write {i} refused"
        newest = [key(i) for i in range(ROUNDS * PER_ROUND - PER_ROUND, ROUNDS * PER_ROUND)]
        assert all(await tier.get_into(newest, [memoryview(bytearray(BIG_BLOCK_BYTES)) for _ in newest]))
        assert tier.stats()["central_freed"] > 0
    finally:
        await tier.close()


async def test_central_ttl_sets_an_expiry_on_what_central_holds(redis_factory: Callable[..., RedisServer]) -> None:
    """With central_ttl_s, committed values and version keys expire (central then frees room by itself)."""
    central = redis_factory(maxmemory=SMALL_CENTRAL, maxmemory_policy="noeviction")
    tier = big_tier(central, redis_factory(), central_ttl_s=CENTRAL_TTL_S)
    await tier.start()
    try:
        assert tier.stats()["central_retention_stops"] == 0
        await put_big(tier, 0, 1)
        assert tier.central is not None
        assert int(central.cli("PTTL", tier.central.keys.value(key(0)))) > 0
        assert int(central.cli("PTTL", tier.central.keys.version(key(0)))) > 0

        async def expired() -> bool:
            return int(central.cli("EXISTS", tier.central.keys.value(key(0)))) == 0

        await eventually(expired)
    finally:
        await tier.close()

