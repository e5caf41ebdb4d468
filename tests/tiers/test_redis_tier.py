"""The Redis tier against a real redis-server: round trips, options, capacity, stats."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
from redis.crc import key_slot as redis_key_slot
from support.proxies import CountingProxy

from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.config import ConfigError, build_dataclass
from tiercache.testing.redis_servers import empty_dests, random_blocks, remote_context
from tiercache.tiers import tier_class
from tiercache.tiers.base import Presence
from tiercache.tiers.redis import RedisOptions, RedisTier, key_slot

HELD, ABSENT = Presence.HELD, Presence.ABSENT

BLOCK = 64 * 1024
SHORT = {"timeout_s": 0.5, "connect_timeout_s": 0.5}


async def open_tier(url: str, block_bytes: int = BLOCK, **options: object) -> RedisTier:
    tier = RedisTier(remote_context(block_bytes), RedisOptions(url=url, **{**SHORT, **options}))
    await tier.start()
    return tier


def raw_client(server) -> redis.Redis:
    return redis.Redis(host=server.host, port=server.port)


async def test_round_trip_contains_delete_and_stats(redis_server) -> None:
    tier = await open_tier(redis_server.url)
    try:
        keys, payloads = random_blocks(40, BLOCK)
        assert await tier.contains(keys[:3]) == [ABSENT] * 3
        assert await tier.put(keys, payloads) == [True] * 40
        assert await tier.contains(keys[:3]) == [HELD] * 3
        out = empty_dests(40, BLOCK)
        assert await tier.get_into(keys, out) == [True] * 40
        assert all(bytes(a) == bytes(b) for a, b in zip(payloads, out, strict=True))
        await tier.delete(keys[:10])
        assert await tier.get_into(keys[:12], out[:12]) == [False] * 10 + [True] * 2
        stats = tier.stats()
        assert stats["put_ok"] == 40
        assert stats["get_hit"] == 42 and stats["hits"] == 42
        assert stats["get_miss"] == 10 and stats["misses"] == 10
        assert stats["bytes_read"] == 42 * BLOCK
        assert stats["bytes_written"] == 40 * (BLOCK + HEADER_SIZE)
        assert stats["contains_hit"] == 3 and stats["contains_miss"] == 3
        assert stats["nodes"] == 1
        assert not [name for name in stats if name.startswith("breaker_")], "a single server's breaker is its lane's"
    finally:
        await tier.close()


async def test_a_presence_check_of_a_prompts_blocks_is_one_round_trip(redis_server) -> None:
    large = 4 << 20  # the window for values this large is one request in flight
    with CountingProxy(redis_server.port) as proxy:
        tier = await open_tier(proxy.url, large)
        try:
            assert tier.window == 1
            keys = [os.urandom(16) for _ in range(300)]
            assert await tier.contains(keys[:1]) == [ABSENT]  # the connection is open
            before = proxy.request_bursts
            assert await tier.contains(keys) == [ABSENT] * len(keys)
            # two sends (a send is half the keys' window), each read by the proxy in one or two parts; a window of
            # values at a time would be a send per key
            assert proxy.request_bursts - before <= 4, "the keys were asked a window of values at a time"
        finally:
            await tier.close()


async def test_one_key_per_block_with_prefix_and_one_value(redis_server) -> None:
    tier = await open_tier(redis_server.url, key_prefix="kv:model-a:")
    try:
        keys, payloads = random_blocks(3, BLOCK)
        await tier.put(keys, payloads)
        client = raw_client(redis_server)
        stored = sorted(client.keys("*"))
        assert stored == sorted(b"kv:model-a:" + k.hex().encode() for k in keys)
        assert client.strlen(stored[0]) == HEADER_SIZE + BLOCK
    finally:
        await tier.close()


@pytest.mark.parametrize("options", [{"stage_reads": True}, {"compress": True}, {"connections": 1}])
async def test_options_round_trip(redis_server, options: dict) -> None:
    tier = await open_tier(redis_server.url, **options)
    try:
        keys, payloads = random_blocks(9, BLOCK)
        payloads[0][:] = bytes(BLOCK)  # compressible
        assert await tier.put(keys, payloads) == [True] * 9
        out = empty_dests(9, BLOCK)
        assert await tier.get_into(keys, out) == [True] * 9
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
        if options.get("compress"):
            assert raw_client(redis_server).strlen(tier.redis_key(keys[0])) < BLOCK // 10
    finally:
        await tier.close()


async def test_ttl_expires_entries(redis_server) -> None:
    tier = await open_tier(redis_server.url, ttl_s=0.2)
    try:
        keys, payloads = random_blocks(2, BLOCK)
        await tier.put(keys, payloads)
        assert 0 < raw_client(redis_server).pttl(tier.redis_key(keys[0])) <= 200
        await asyncio.sleep(0.3)
        assert await tier.contains(keys) == [ABSENT, ABSENT]
    finally:
        await tier.close()


async def test_acl_user_and_wrong_password(redis_factory, caplog) -> None:
    server = redis_factory(extra_args=[
        "--user", "default", "off", "--user", "engine", "on", ">s3cret", "~*", "&*", "+@all",
    ])
    good = await open_tier(f"redis://engine:s3cret@{server.host}:{server.port}")
    bad = await open_tier(server.url, username="engine", password="wrong")
    try:
        keys, payloads = random_blocks(2, BLOCK)
        assert await good.put(keys, payloads) == [True, True]
        assert await bad.get_into(keys, empty_dests(2, BLOCK)) == [False, False]
        stats = bad.stats()
        assert stats.get("get_auth_wrongpass") == 2, stats
        assert str(stats["last_error"]).startswith("auth_wrongpass: WRONGPASS")
        assert "WRONGPASS" in caplog.text and "maxmemory" not in caplog.text
    finally:
        await good.close()
        await bad.close()


async def test_no_password_against_requirepass_is_named_noauth(redis_factory, caplog) -> None:
    server = redis_factory(extra_args=["--requirepass", "s3cret"])
    anonymous = await open_tier(server.url)
    keyed = await open_tier(server.url, password="s3cret")
    try:
        keys, payloads = random_blocks(2, BLOCK)
        assert await anonymous.put(keys, payloads) == [False, False]
        stats = anonymous.stats()
        assert stats.get("put_auth_noauth") == 2, stats
        assert "NOAUTH" in str(stats["last_error"])
        assert "NOAUTH" in caplog.text and "has no maxmemory" not in caplog.text
        assert await keyed.put(keys, payloads) == [True, True]
        assert "last_error" not in keyed.stats()
    finally:
        await anonymous.close()
        await keyed.close()


async def test_acl_denials_are_named_noperm(redis_factory, caplog) -> None:
    server = redis_factory(extra_args=[
        "--user", "default", "on", "nopass", "~*", "&*", "+@all",
        "--user", "writer", "on", ">pw", "~*", "&*", "+@all", "-get",
        "--user", "blind", "on", ">pw", "~*", "&*", "+@all", "-config", "-info",
    ])
    writer = await open_tier(server.url, username="writer", password="pw")
    blind = await open_tier(server.url, username="blind", password="pw")
    try:
        keys, payloads = random_blocks(2, BLOCK)
        assert await writer.put(keys, payloads) == [True, True]
        assert await writer.get_into(keys, empty_dests(2, BLOCK)) == [False, False]
        stats = writer.stats()
        assert stats.get("get_auth_noperm") == 2 and "NOPERM" in str(stats["last_error"]), stats
        assert await blind.put(keys, payloads) == [False, False]
        assert blind.stats().get("put_refused_noperm") == 2
        assert "does not let this user read maxmemory" in caplog.text and "NOPERM" in caplog.text
        assert "has no maxmemory" not in caplog.text
        assert await blind.get_into(keys, empty_dests(2, BLOCK)) == [True, True]
    finally:
        await writer.close()
        await blind.close()


async def test_denied_sets_among_stored_ones_are_counted_each_in_its_place(redis_factory) -> None:
    """SET replies are read in bulk while they are all ``+OK``; an error among them (here an ACL
    that lets this user write only keys whose hex starts with 0) must land on its own value."""
    server = redis_factory(extra_args=[
        "--user", "default", "on", "nopass", "~*", "&*", "+@all",
        "--user", "zeros", "on", ">pw", "~tiercache:0*", "&*", "+@all",
    ])
    tier = await open_tier(server.url, username="zeros", password="pw")
    reader = await open_tier(server.url)
    try:
        _, payloads = random_blocks(48, BLOCK)
        allowed = [True] * 20 + [i % 2 == 0 for i in range(20)] + [False] * 4 + [True] * 4
        keys = [(b"\x00" if ok else b"\xff") + b"%015d" % i for i, ok in enumerate(allowed)]
        assert await tier.put(keys, payloads) == allowed
        stats = tier.stats()
        assert stats["put_ok"] == sum(allowed) and stats["put_auth_noperm"] == len(allowed) - sum(allowed)
        out = empty_dests(48, BLOCK)
        assert await reader.get_into(keys, out) == allowed
        assert all(bytes(out[i]) == bytes(payloads[i]) for i, ok in enumerate(allowed) if ok)
    finally:
        await tier.close()
        await reader.close()


async def test_unbounded_server_refuses_writes_unless_allowed(redis_factory) -> None:
    server = redis_factory(maxmemory="0", maxmemory_policy="noeviction")
    refusing = await open_tier(server.url)
    allowed = await open_tier(server.url, allow_unbounded=True)
    try:
        keys, payloads = random_blocks(2, BLOCK)
        assert await refusing.put(keys, payloads) == [False, False]
        assert refusing.stats()["put_refused_unbounded"] == 2
        assert await allowed.put(keys, payloads) == [True, True]
        assert await refusing.get_into(keys, empty_dests(2, BLOCK)) == [True, True]
    finally:
        await refusing.close()
        await allowed.close()


async def test_full_noeviction_server_fails_writes_as_values(redis_factory) -> None:
    server = redis_factory(maxmemory="4mb", maxmemory_policy="noeviction")
    tier = await open_tier(server.url)
    try:
        keys, payloads = random_blocks(200, BLOCK)
        results = await tier.put(keys, payloads)
        assert results[0] and not results[-1]
        assert tier.stats()["put_server_oom"] == results.count(False)
    finally:
        await tier.close()


async def test_evicting_server_stays_bounded(redis_factory) -> None:
    server = redis_factory(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    tier = await open_tier(server.url)
    try:
        keys, payloads = random_blocks(200, BLOCK)
        assert all(await tier.put(keys, payloads))
        assert int(raw_client(server).info("memory")["used_memory"]) < 8 * 2**20
        assert (await tier.contains(keys)).count(HELD) < 100
    finally:
        await tier.close()


def test_options_are_validated_by_config() -> None:
    options_type = tier_class("redis").Options
    assert build_dataclass(options_type, {"url": "redis://h:1", "cluster": True}, "t.yaml", "o").cluster
    with pytest.raises(ConfigError, match=r"o(: .*|\.)url"):
        build_dataclass(options_type, {"url": "http://h"}, "t.yaml", "o")
    with pytest.raises(ConfigError, match="timeout_s"):
        build_dataclass(options_type, {"timeout_s": 0}, "t.yaml", "o")


def test_key_slot_matches_redis_py() -> None:
    for key in (b"foo", b"tiercache:00ff", b"a{user1}b", b"{}x", b"{x", b"{a}{b}"):
        assert key_slot(key) == redis_key_slot(key)
