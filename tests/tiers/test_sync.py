"""Central/regional sync against three real redis-servers: central plus regions A and B."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch
from support.manager_helpers import TINY_LAYOUT, block_kv, read_block, topology, write_block
from support.sync_sites import (
    BLOCK_BYTES,
    FAST_RETRIES,
    FINGERPRINT,
    PATIENT,
    Topology,
    eventually,
    hold_writes,
    key,
    payload,
    read,
    release_writes,
)

from tiercache.blocks.codec import Codec
from tiercache.manager.tier_manager import TierManager
from tiercache.remote.inspect import inspect_topology
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier, value_version

INSPECT_TIMEOUT_S = 10.0
"""Generous: a failure detector for a hung check, not a speed requirement."""


async def test_read_your_writes_before_and_after_replication(sites: Topology) -> None:
    a = await sites.tier(sites.region_a, **PATIENT)
    b = await sites.tier(sites.region_b)
    hold_writes(sites.central)
    assert await a.put([key(1)], [payload(1)]) == [True]
    assert await read(a, [key(1)], force_latest=True) == [bytes(payload(1))]
    assert await a.central.versions([key(1)]) == [0]
    assert await read(b, [key(1)], force_latest=True) == [None]
    assert await read(b, [key(1)]) == [None]
    release_writes(sites.central)
    await a.flush()
    (version,) = await a.central.versions([key(1)])
    assert version > 0
    assert value_version((await a.region.read([key(1)]))[0]) == version
    assert await read(b, [key(1)], force_latest=True) == [bytes(payload(1))]
    assert value_version((await b.region.read([key(1)]))[0]) == version
    assert a.stats()["own_unreplicated"] == 0


async def test_force_latest_sees_a_write_from_the_other_region(sites: Topology) -> None:
    a = await sites.tier(sites.region_a, invalidate=False)
    b = await sites.tier(sites.region_b)
    await a.put([key(2)], [payload(10)])
    await a.flush()
    assert await read(b, [key(2)]) == [bytes(payload(10))]
    await b.put([key(2)], [payload(20)])
    await b.flush()
    assert await read(a, [key(2)]) == [bytes(payload(10))]
    assert await read(a, [key(2)], force_latest=True) == [bytes(payload(20))]
    assert a.stats()["refreshed"] == 1
    assert await read(a, [key(2)]) == [bytes(payload(20))]
    (central_version,) = await a.central.versions([key(2)])
    assert value_version((await a.region.read([key(2)]))[0]) == central_version


async def test_central_publishes_and_regions_drop_stale_copies(sites: Topology) -> None:
    a = await sites.tier(sites.region_a)
    b = await sites.tier(sites.region_b)
    await a.put([key(3)], [payload(30)])
    await a.flush()
    await b.put([key(3)], [payload(31)])
    await b.flush()

    async def dropped() -> bool:
        return a.stats()["invalidated"] >= 1 and (await a.region.read([key(3)])) == [None]

    await eventually(dropped)
    assert await read(a, [key(3)]) == [bytes(payload(31))]
    assert a.stats()["read_through"] == 1


async def test_replication_lag_and_its_bounded_queue(sites: Topology) -> None:
    a = await sites.tier(sites.region_a, replication_queue_blocks=4, **PATIENT)
    b = await sites.tier(sites.region_b)
    hold_writes(sites.central)
    keys = [key(100 + i) for i in range(6)]
    assert await a.put(keys, [payload(i) for i in range(6)]) == [True] * 6
    stats = a.stats()
    assert stats["replication_dropped"] == 2
    assert await read(b, keys, force_latest=True) == [None] * 6
    release_writes(sites.central)
    await a.flush()
    stats = a.stats()
    assert (stats["replicated"], stats["replication_queue"]) == (4, 0)
    assert stats["replication_lag_ms_max"] > 0
    assert await read(b, keys, force_latest=True) == [bytes(payload(i)) for i in range(4)] + [None, None]
    # The dropped ones stay readable in their region, unversioned.
    assert await read(a, keys[4:]) == [bytes(payload(4)), bytes(payload(5))]


async def test_central_down_regions_serve_what_they_hold_but_not_as_latest(sites: Topology) -> None:
    a = await sites.tier(sites.region_a, **FAST_RETRIES)
    await a.put([key(4)], [payload(40)])
    await a.flush()
    sites.central.kill()
    assert await read(a, [key(4)]) == [bytes(payload(40))]
    assert await read(a, [key(4)], force_latest=True) == [None]
    assert a.stats()["latest_unavailable"] == 1
    assert await a.put([key(5)], [payload(50)]) == [True]
    await a.flush()
    assert a.stats()["replication_failed"] == 1
    assert await read(a, [key(5)]) == [bytes(payload(50))]
    assert await read(a, [key(5)], force_latest=True) == [None]


async def test_region_down_reads_and_writes_go_through_central(sites: Topology) -> None:
    a = await sites.tier(sites.region_a, **FAST_RETRIES)
    b = await sites.tier(sites.region_b)
    await a.put([key(6)], [payload(60)])
    await a.flush()
    sites.region_a.kill()
    assert await read(a, [key(6)]) == [bytes(payload(60))]
    assert await read(a, [key(6)], force_latest=True) == [bytes(payload(60))]
    assert await a.put([key(7)], [payload(70)]) == [True]
    await a.flush()
    assert await read(b, [key(7)], force_latest=True) == [bytes(payload(70))]


async def test_central_mode_versions_are_monotonic_even_across_a_restart(sites: Topology) -> None:
    c = await sites.tier(None)
    await c.put([key(8)], [payload(1)])
    (first,) = await c.central.versions([key(8)])
    await c.put([key(8)], [payload(2)])
    (second,) = await c.central.versions([key(8)])
    assert second > first > 0
    assert await read(c, [key(8)], force_latest=True) == [bytes(payload(2))]
    sites.central.restart()

    async def rewritten() -> bool:
        # The first request of each connection after the restart may fail on the dropped connection.
        return await c.put([key(8)], [payload(3)]) == [True] and await c.central.versions([key(8)]) is not None

    await eventually(rewritten)
    (third,) = await c.central.versions([key(8)])
    assert third > second
    assert await read(c, [key(8)]) == [bytes(payload(3))]


async def test_manager_force_latest_bypasses_its_cpu_copy(sites: Topology) -> None:
    remote = {
        "type": "regional",
        "name": "regional",
        "options": {"central_url": sites.central.url, "region_url": sites.region_a.url, "invalidate": False},
    }
    block = TINY_LAYOUT["block_size"]
    tokens = np.arange(2 * block)
    async with TierManager(topology(4, 16, remotes=[remote])) as manager:
        keys = manager.hasher.keys(tokens)
        ids = manager.allocate(2)
        for k, b in zip(keys, ids, strict=True):
            write_block(manager, b, block_kv(manager, k))
        await manager.store(tokens, ids)
        manager.release(ids)
        tier = manager.parts.remotes[0]
        assert isinstance(tier, RegionalTier)

        async def replicated() -> bool:
            return tier.stats().get("replicated", 0) == 2

        await eventually(replicated)
        other = await sites.tier(sites.region_b, codec=Codec(manager.namespace.root()))
        other.block_bytes = manager.layout.bytes_per_block
        newer = [torch.full(manager.layout.block_shape, float(i + 7)) for i in range(2)]
        await other.put(keys, [memoryview(t.contiguous().view(torch.uint8).numpy()) for t in newer])
        await other.flush()

        async def load(force_latest: bool) -> list[torch.Tensor]:
            manager.release(manager.allocate(4))
            hit = manager.lookup(tokens)
            assert hit.tier_blocks["cpu"] == 2
            fresh = manager.allocate(2)
            assert await manager.load(hit, fresh, force_latest=force_latest) == 2 * block
            blocks = [read_block(manager, b) for b in fresh]
            manager.release(fresh)
            return blocks

        assert all(torch.equal(x, block_kv(manager, k)) for x, k in zip(await load(False), keys, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(await load(True), newer, strict=True))


async def test_frozen_central_opens_the_breaker_and_recovers(sites: Topology) -> None:
    """A hung central costs a few timeouts, then force_latest reads are misses at once; it comes back by itself."""
    a = await sites.tier(
        sites.region_a, **FAST_RETRIES, breaker_failures=2, breaker_backoff_s=0.05, breaker_backoff_max_s=0.05
    )
    await a.put([key(30)], [payload(3)])
    await a.flush()
    sites.central.stop()
    try:
        for _ in range(6):
            assert await read(a, [key(30)], force_latest=True) == [None]
        stats = a.stats()
        assert stats["central_breaker_opened"] >= 1
        assert stats["central_breaker_rejected"] >= 1, "an open breaker must refuse calls instead of waiting"
        assert stats["region_breaker_open"] == 0
        assert await read(a, [key(30)]) == [bytes(payload(3))], "the region keeps serving plain reads"
    finally:
        sites.central.cont()
    await eventually(lambda: _latest_is(a, key(30), bytes(payload(3))))
    assert a.stats()["central_breaker_open"] == 0


async def _latest_is(tier: RegionalTier, block: bytes, expected: bytes) -> bool:
    return await read(tier, [block], force_latest=True) == [expected]


async def test_garbage_keys_are_misses_for_themselves_only(
    sites: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 11 item 3: one garbage value or version key used to fail the whole force_latest chunk."""
    a = await sites.tier(sites.region_a, invalidate=False)
    keys = [key(500 + i) for i in range(24)]
    await a.put(keys, [payload(i) for i in range(24)])
    await a.flush()
    region = aioredis.Redis.from_url(sites.region_a.url)
    central = aioredis.Redis.from_url(sites.central.url)
    try:
        await region.set(a.region.keys.value(keys[10]), b"short")  # central still holds it
        await central.set(a.central.keys.version(keys[11]), b"not-a-version")
        await region.set(a.region.keys.value(keys[12]), b"\x00" * 7)
        await central.set(a.central.keys.value(keys[12]), b"tiny")
    finally:
        await region.aclose()
        await central.aclose()
    with caplog.at_level("WARNING"):
        got = await read(a, keys, force_latest=True)
    expected = [bytes(payload(i)) for i in range(24)]
    expected[11] = expected[12] = None
    assert got == expected
    stats = a.stats()
    assert stats["invalid_versions"] == 1
    assert stats["invalid_values"] == 3  # keys 10 and 12 in the region, key 12 at central
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_invalid_values_are_deleted_from_their_store(sites: Topology) -> None:
    """Issue 10 defect 8: a value that fails validation is removed where it was read, unless rewritten since."""
    a = await sites.tier(sites.region_a, invalidate=False)
    c = await sites.tier(None)
    keys = [key(600 + i) for i in range(3)]
    await c.put(keys[1:2], [payload(1)])
    region = aioredis.Redis.from_url(sites.region_a.url)
    central = aioredis.Redis.from_url(sites.central.url)
    try:
        good = Codec(FINGERPRINT).encode_value(keys[0], payload(0))
        await region.set(a.region.keys.value(keys[0]), good[:-1] + b"!")  # central never had it
        await central.setrange(c.central.keys.value(keys[1]), len(good) - 1, b"!")
        assert await read(a, keys[:1]) == [None]
        assert await read(c, keys[1:2]) == [None]

        async def deleted() -> bool:
            return a.stats()["invalid_deleted"] == 1 and c.stats()["invalid_deleted"] == 1

        await eventually(deleted)
        assert await region.exists(a.region.keys.value(keys[0])) == 0
        assert await central.exists(c.central.keys.value(keys[1])) == 0
        # A value rewritten since it was read is kept.
        await region.set(a.region.keys.value(keys[2]), b"garbage")
        await a.put(keys[2:], [payload(9)])
        assert await a.region.discard([(keys[2], b"garbage")]) == 0
        assert await read(a, keys[2:]) == [bytes(payload(9))]
    finally:
        await region.aclose()
        await central.aclose()


CENTRAL_PASSWORD = "central-secret"
REGION_PASSWORD = "region-secret"


def with_password(server: RedisServer, password: str, user: str = "") -> str:
    return f"redis://{user}:{password}@{server.address}"


@pytest.fixture
def guarded(redis_factory: Callable[..., RedisServer]) -> tuple[RedisServer, RedisServer]:
    """A central and a region that require passwords (``requirepass``)."""
    return (
        redis_factory(extra_args=["--requirepass", CENTRAL_PASSWORD]),
        redis_factory(extra_args=["--requirepass", REGION_PASSWORD]),
    )


async def test_auth_failures_are_named_per_server(
    guarded: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 11 item 7: a rejected or missing password, or an ACL denial, is named for central and region apart."""
    central, region = guarded
    admin = aioredis.Redis.from_url(with_password(central, CENTRAL_PASSWORD))
    try:
        await admin.execute_command("ACL", "SETUSER", "noeval", "on", ">pw", "~*", "&*", "+@all", "-eval")
    finally:
        await admin.aclose()
    cases = [
        (with_password(central, "wrong"), with_password(region, REGION_PASSWORD), "central", "wrongpass"),
        (central.url, with_password(region, REGION_PASSWORD), "central", "noauth"),
        (with_password(central, "pw", "noeval"), with_password(region, REGION_PASSWORD), "central", "noperm"),
        (with_password(central, CENTRAL_PASSWORD), with_password(region, "wrong"), "region", "wrongpass"),
    ]
    for central_url, region_url, role, cause in cases:
        caplog.clear()
        options = RegionalOptions(central_url=central_url, region_url=region_url, invalidate=False, **FAST_RETRIES)
        tier = RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BLOCK_BYTES), options)
        with caplog.at_level("WARNING"):
            await tier.start()
            try:
                await tier.put([key(700)], [payload(7)])
                await tier.flush()
                stats = tier.stats()
            finally:
                await tier.close()
        other = "region" if role == "central" else "central"
        assert stats[f"{role}_errors_{cause}"] > 0, (role, cause)
        assert stats[f"{role}_auth_failed"] > 0
        assert stats[f"{other}_auth_failed"] == 0
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"{role} redis://" in m and f"with {cause.upper()}" in m for m in messages), messages
        assert not any(CENTRAL_PASSWORD in m or REGION_PASSWORD in m for m in messages)


def test_inspect_checks_central_and_region_apart(guarded: tuple[RedisServer, RedisServer]) -> None:
    """Issue 11 item 7: a central that rejects the password used to be reported reachable by ``inspect``."""
    central, region = guarded

    def inspect(central_url: str) -> tuple[str, bool]:
        options = {"central_url": central_url, "region_url": with_password(region, REGION_PASSWORD)}
        remote = {"type": "regional", "name": "regional", "options": options}
        return inspect_topology(topology(4, 16, remotes=[remote]), timeout=INSPECT_TIMEOUT_S)

    report, ok = inspect(with_password(central, "wrong"))
    assert not ok
    connectivity = report.split("connectivity:")[1].splitlines()
    (line,) = [line for line in connectivity if line.strip().startswith("regional ")]
    assert "UNREACHABLE" in line and "WRONGPASS" in line
    (central_line,) = [line for line in connectivity if line.strip().startswith("central ")]
    assert "UNREACHABLE" in central_line and "WRONGPASS" in central_line and ":wrong@" not in central_line
    (region_line,) = [line for line in connectivity if line.strip().startswith("region ")]
    assert "reachable" in region_line and "UNREACHABLE" not in region_line
    report, ok = inspect(with_password(central, CENTRAL_PASSWORD))
    assert ok, report
