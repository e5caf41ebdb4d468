"""force_latest when central cannot answer, and a central that is full: real redis-servers.

force_latest serves the newest version committed at central when the read
began (and this node's own acknowledged writes), which only central can tell:
with central unreachable, or its breaker open, every force_latest read is a
miss, this node's unreplicated writes included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from redis_servers import RedisServer
from sync_sites import FAST_RETRIES, FINGERPRINT, Topology, eventually, key, payload, read

from tiercache.codec import Codec
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier

OWN_WRITES = 8
OPEN_FOR_S = 60.0
"""The central breaker's back-off: it stays open for the whole test once tripped."""


async def test_an_open_central_breaker_makes_force_latest_miss_even_own_writes(sites: Topology) -> None:
    a = await sites.tier(
        sites.region_a,
        **FAST_RETRIES,
        invalidate=False,
        breaker_failures=2,
        breaker_backoff_s=OPEN_FOR_S,
        breaker_backoff_max_s=OPEN_FOR_S,
    )
    keys = [key(200 + i) for i in range(OWN_WRITES)]
    written = [bytes(payload(i)) for i in range(OWN_WRITES)]
    a.pause_replication()
    assert await a.put(keys, [payload(i) for i in range(OWN_WRITES)]) == [True] * OWN_WRITES
    assert await read(a, keys, force_latest=True) == written, "central up: this node reads its own writes"
    sites.central.kill()
    while not a.stats()["central_breaker_open"]:
        assert await read(a, [key(999)], force_latest=True) == [None]
    unavailable = a.stats()["latest_unavailable"]
    assert await read(a, keys, force_latest=True) == [None] * OWN_WRITES, "no latest without central's word"
    assert a.stats()["latest_unavailable"] == unavailable + OWN_WRITES
    assert await read(a, keys) == written, "plain reads still serve the region's copies"
    a.resume_replication()


BIG_BLOCK_BYTES = 64 * 1024
SMALL_CENTRAL = "3mb"
"""Room for a few dozen 64 KiB values beside the server's own ~1 MB."""
CENTRAL_TTL_S = 3.0
"""Long enough to see the TTL set, short enough to wait for the expiry."""


def big_tier(central: RedisServer, region: RedisServer, **options: Any) -> RegionalTier:
    opts = RegionalOptions(central_url=central.url, region_url=region.url, invalidate=False, **FAST_RETRIES, **options)
    return RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BIG_BLOCK_BYTES), opts)


async def put_big(tier: RegionalTier, first: int, count: int) -> None:
    for i in range(first, first + count):
        assert await tier.put([key(i)], [memoryview(bytes([i % 256]) * BIG_BLOCK_BYTES)]) == [True]
    await tier.flush()


async def test_full_central_is_announced_counted_and_logged(
    redis_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 11 item 4: a full noeviction central used to stop replication with no log line and no counter."""
    central = redis_factory(maxmemory=SMALL_CENTRAL, maxmemory_policy="noeviction")
    tier = big_tier(central, redis_factory())
    with caplog.at_level("WARNING"):
        await tier.start()
        try:
            assert tier.stats()["central_retention_stops"] == 1
            assert any("maxmemory-policy noeviction" in r.getMessage() for r in caplog.records)
            await put_big(tier, 0, 80)
            stats = tier.stats()
        finally:
            await tier.close()
    assert stats["replicated"] > 0
    assert stats["replication_failed"] > 0
    assert stats["central_commit_failed"] >= stats["replication_failed"]
    assert stats["central_errors_oom"] > 0
    assert any("failed with OOM" in r.getMessage() for r in caplog.records)
    assert any("gave up replicating" in r.getMessage() for r in caplog.records)


async def test_central_ttl_frees_a_full_central(redis_factory: Callable[..., RedisServer]) -> None:
    """With central_ttl_s, committed values and version keys expire, so a full central takes commits again."""
    central = redis_factory(maxmemory=SMALL_CENTRAL, maxmemory_policy="noeviction")
    tier = big_tier(central, redis_factory(), central_ttl_s=CENTRAL_TTL_S)
    await tier.start()
    try:
        assert tier.stats()["central_retention_stops"] == 0
        await put_big(tier, 0, 1)
        assert tier.central is not None
        assert int(central.cli("PTTL", tier.central.keys.value(key(0)))) > 0
        assert int(central.cli("PTTL", tier.central.keys.version(key(0)))) > 0
        await put_big(tier, 1, 80)
        assert tier.stats()["replication_failed"] > 0, "central must have been full"
        replicated = tier.stats()["replicated"]

        async def commits_again() -> bool:
            await put_big(tier, 1000, 1)
            return tier.stats()["replicated"] > replicated

        await eventually(commits_again)
    finally:
        await tier.close()
