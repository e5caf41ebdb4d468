"""Remote failures are misses, counted, never exceptions; a dead server is not hammered;
the tier recovers by itself. All with real redis-server processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis

from tiercache.blocks.codec import HEADER_SIZE, Codec
from tiercache.testing.redis_servers import (
    FINGERPRINT,
    OTHER_FINGERPRINT,
    RedisServer,
    empty_dests,
    random_blocks,
    remote_context,
)
from tiercache.tiers.base import Presence, RemoteContext
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 64 * 1024
FAST = {
    "timeout_s": 0.3,
    "connect_timeout_s": 0.3,
    "breaker_failures": 2,
    "breaker_backoff_s": 0.2,
    "breaker_backoff_max_s": 0.4,
}


async def open_tier(url: str, block_bytes: int = BLOCK, **options: object) -> RedisTier:
    tier = RedisTier(remote_context(block_bytes), RedisOptions(url=url, **{**FAST, **options}))
    await tier.start()
    return tier


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_refused_then_breaker_then_recovery(tmp_path) -> None:
    server = RedisServer(tmp_path)
    server.port = 0
    server.start()
    server.kill()  # the port is now refused
    tier = await open_tier(server.url)
    try:
        keys, payloads = random_blocks(4, BLOCK)
        for _ in range(4):
            assert await tier.get_into(keys, empty_dests(4, BLOCK)) == [False] * 4
            assert await tier.put(keys, payloads) == [False] * 4
        stats = tier.stats()
        assert stats.get("get_connect", 0) >= 4 and stats["breaker_opened"] >= 1
        assert stats.get("get_breaker_open", 0) + stats.get("put_breaker_open", 0) > 0
        assert stats["misses"] == 16
        server.start()

        async def writes() -> bool:
            return all(await tier.put(keys, payloads))

        await wait_until(writes)
        assert tier.stats()["breaker_state"] == 0
        assert await tier.get_into(keys, empty_dests(4, BLOCK)) == [True] * 4
    finally:
        await tier.close()
        server.close()


async def test_killed_mid_batch_keeps_the_valid_prefix(redis_server) -> None:
    block = 256 * 1024
    tier = await open_tier(redis_server.url, block, connections=1, timeout_s=2.0)
    try:
        keys, payloads = random_blocks(300, block)
        assert all(await tier.put(keys, payloads))
        out = empty_dests(300, block)
        asyncio.get_running_loop().call_later(0.01, redis_server.kill)
        results = await tier.get_into(keys, out)
        served = results.index(False)
        assert results == [True] * served + [False] * (300 - served)
        assert all(bytes(out[i]) == bytes(payloads[i]) for i in range(served))
        assert tier.stats().get("get_connection", 0) + tier.stats().get("get_connect", 0) == 300 - served
        redis_server.restart()

        async def recovered() -> bool:
            return all(await tier.put(keys[:2], payloads[:2]))

        await wait_until(recovered)
    finally:
        await tier.close()


async def test_frozen_server_times_out_then_recovers(redis_server) -> None:
    tier = await open_tier(redis_server.url)
    try:
        keys, payloads = random_blocks(8, BLOCK)
        assert all(await tier.put(keys, payloads))
        redis_server.stop()
        assert await tier.get_into(keys, empty_dests(8, BLOCK)) == [False] * 8
        assert await tier.contains(keys) == [Presence.UNKNOWN] * 8  # no answer is not "absent"
        assert tier.stats().get("get_timeout", 0) == 8 and "timeout" in str(tier.stats()["last_error"])
        redis_server.cont()

        async def reads() -> bool:
            return all(await tier.get_into(keys, empty_dests(8, BLOCK)))

        await wait_until(reads)
    finally:
        redis_server.cont()
        await tier.close()


async def test_bad_values_are_misses_and_the_rest_is_served(redis_server) -> None:
    tier = await open_tier(redis_server.url)
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        keys, payloads = random_blocks(7, BLOCK)
        assert all(await tier.put(keys, payloads))
        good = client.get(tier.redis_key(keys[0]))
        flipped = bytearray(client.get(tier.redis_key(keys[2])))
        flipped[-1] ^= 0xFF
        foreign = Codec(OTHER_FINGERPRINT).encode_value(keys[4], payloads[4])
        own = client.get(tier.redis_key(keys[3]))
        for stage_reads in (False, True):  # each reader deletes the bad values it found: store them again
            client.set(tier.redis_key(keys[1]), b"\x00garbage" * 100)
            client.set(tier.redis_key(keys[2]), bytes(flipped))
            client.set(tier.redis_key(keys[3]), own[: HEADER_SIZE + BLOCK // 2])
            client.set(tier.redis_key(keys[4]), foreign)
            client.set(tier.redis_key(keys[5]), good)  # another key's value
            reader = await open_tier(redis_server.url, stage_reads=stage_reads)
            out = empty_dests(7, BLOCK)
            assert await reader.get_into(keys, out) == [True, False, False, False, False, False, True]
            assert bytes(out[0]) == bytes(payloads[0]) and bytes(out[6]) == bytes(payloads[6])
            stats = reader.stats()
            assert stats.get("get_bad_magic", 0) == 1 and stats.get("get_bad_checksum", 0) == 1
            assert stats.get("get_truncated", 0) == 1
            assert stats.get("get_wrong_namespace", 0) == 1 and stats.get("get_wrong_key", 0) == 1
            assert stats["misses"] == 5 and stats["breaker_state"] == 0
            await reader.settle()
            # damaged values go; another namespace's value is not this reader's to judge and stays
            assert reader.stats()["invalid_deleted"] == 4 and reader.stats()["invalid_kept"] == 1
            assert [client.exists(tier.redis_key(key)) for key in keys[1:6]] == [0, 0, 0, 1, 0]
            await reader.close()
    finally:
        client.close()
        await tier.close()


async def test_cancelled_read_leaves_the_tier_usable(redis_server) -> None:
    block = 256 * 1024
    tier = await open_tier(redis_server.url, block)
    try:
        keys, payloads = random_blocks(200, block)
        assert all(await tier.put(keys, payloads))
        task = asyncio.ensure_future(tier.get_into(keys, empty_dests(200, block)))
        await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await tier.get_into(keys[:3], empty_dests(3, block)) == [True] * 3
    finally:
        await tier.close()


async def test_invalid_values_are_deleted_so_the_next_store_rewrites_them(redis_server) -> None:
    tier = await open_tier(redis_server.url)
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        keys, payloads = random_blocks(6, BLOCK)
        assert all(await tier.put(keys, payloads))
        names = [tier.redis_key(k) for k in keys]
        flipped = bytearray(client.get(names[1]))
        flipped[HEADER_SIZE + 7] ^= 0xFF
        client.set(names[1], bytes(flipped))
        client.set(names[2], b"\x00garbage" * 100)
        client.set(names[3], client.get(names[3])[: HEADER_SIZE + 10])
        client.set(names[4], client.get(names[0]))
        assert await tier.get_into(keys, empty_dests(6, BLOCK)) == [True, False, False, False, False, True]
        await tier.settle()
        assert [client.exists(n) for n in names] == [1, 0, 0, 0, 0, 1]
        assert tier.stats()["invalid_deleted"] == 4
        assert all(await tier.put(keys, payloads))
        out = empty_dests(6, BLOCK)
        assert await tier.get_into(keys, out) == [True] * 6
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
    finally:
        client.close()
        await tier.close()


async def test_a_forger_with_store_access_but_no_secret_gets_nothing_loaded(redis_server) -> None:
    """Forgeries are misses; they are not the reader's to judge (no MAC, or another key's), so the victim's
    next store overwrites them rather than its readers deleting them."""
    secret = b"the victim's namespace secret!!!"

    async def tier_with(codec: Codec, **options: object) -> RedisTier:
        tier = RedisTier(RemoteContext("remote", codec, BLOCK), RedisOptions(url=redis_server.url, **FAST, **options))
        await tier.start()
        return tier

    victim = await tier_with(Codec(FINGERPRINT, secret=secret))
    forger = await tier_with(Codec(FINGERPRINT))  # knows the namespace (model id, tenant, layout)
    guesser = await tier_with(Codec(FINGERPRINT, secret=b"a guessed secret of 32 bytes...."))
    try:
        keys, payloads = random_blocks(8, BLOCK)
        assert all(await forger.put(keys[:4], payloads[:4]))
        assert all(await guesser.put(keys[4:], payloads[4:]))
        for stage_reads in (False, True):
            reader = await tier_with(Codec(FINGERPRINT, secret=secret), stage_reads=stage_reads)
            assert await reader.get_into(keys, empty_dests(8, BLOCK)) == [False] * 8
            await reader.settle()
            stats = reader.stats()
            assert stats["get_unkeyed"] == 4 and stats["get_other_key"] == 4
            assert stats["invalid_kept"] == 8 and stats["invalid_deleted"] == 0
            await reader.close()
        assert all(await victim.put(keys, payloads))
        out = empty_dests(8, BLOCK)
        assert await victim.get_into(keys, out) == [True] * 8
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
        assert await forger.get_into(keys, empty_dests(8, BLOCK)) == [False] * 8
        assert forger.stats()["get_other_key"] == 8
    finally:
        for tier in (victim, forger, guesser):
            await tier.close()
