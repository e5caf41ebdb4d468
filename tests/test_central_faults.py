"""A central that is full: real redis-servers (moved from ``test_sync``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from redis_servers import RedisServer
from sync_sites import FAST_RETRIES, FINGERPRINT, eventually, key

from tiercache.codec import Codec
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier

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
