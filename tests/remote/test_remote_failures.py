"""Remote failures are misses, counted, never exceptions; a dead server is not hammered;
the tier recovers by itself. All with real redis-server processes.

A single Redis server's breaker is its transfer lane's (the one breaker a read
passes), so what an open breaker does is checked through ``RemoteStore``, as
engines reach the tier; the tier alone only tells the lane when its server failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis
from prometheus_client.parser import text_string_to_metric_families

from tiercache.blocks.codec import Codec
from tiercache.blocks.keys import Namespace
from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.common.breaker import BreakerState
from tiercache.config.remote import remote_topology_from_dict
from tiercache.remote.store import RemoteStore
from tiercache.telemetry.prometheus import render_prometheus
from tiercache.testing.redis_servers import (
    FINGERPRINT,
    OTHER_FINGERPRINT,
    RedisServer,
    empty_dests,
    random_blocks,
    remote_context,
)
from tiercache.tiers.base import CallReport, Presence, RemoteContext, report_calls_into
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 64 * 1024
FAST = {
    "timeout_s": 0.3,
    "connect_timeout_s": 0.3,
    "breaker_failures": 2,
    "breaker_backoff_s": 0.2,
    "breaker_backoff_max_s": 0.4,
}
WAIT_S = 10.0
"""A hang detector for a store's futures, never a speed judgement."""


def store_over(url: str, **options: object) -> RemoteStore:
    """A ``RemoteStore`` over one Redis tier at ``url`` (its lane in front, as engines have it), started."""
    tier = {"name": "redis", "type": "redis", "options": {"url": url, "allow_unbounded": True, **FAST, **options}}
    data = {"tiers": [tier], "queues": {"remote_lookup_timeout_ms": 500}}
    store = RemoteStore(remote_topology_from_dict(data), Namespace("test-model", "fp16:64k"), BLOCK)
    store.start()
    return store


def refused_server(tmp_path) -> RedisServer:
    """A server that is not running: its port refuses connections until ``start``."""
    server = RedisServer(tmp_path)
    server.port = 0
    server.start()
    server.kill()
    return server


async def open_tier(url: str, block_bytes: int = BLOCK, **options: object) -> RedisTier:
    tier = RedisTier(remote_context(block_bytes), RedisOptions(url=url, **{**FAST, **options}))
    await tier.start()
    return tier


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def test_refused_then_breaker_then_recovery(tmp_path) -> None:
    server = refused_server(tmp_path)
    store = store_over(server.url)
    try:
        keys, payloads = random_blocks(4, BLOCK)
        for _ in range(4):
            assert store.read(keys, empty_dests(4, BLOCK)).result(WAIT_S) == [False] * 4
            assert store.write(keys, payloads).result(WAIT_S) == [False] * 4
        stats = store.stats()
        lane = stats["tiers"]["redis"]
        assert lane["store"].get("get_connect", 0) >= 4 and lane["lane_breaker_opened"] >= 1
        assert lane["lane_open_skips"] > 0, "an open breaker answers misses without asking the server"
        assert stats["store"]["read_misses"] == 16 and stats["store"]["writes_failed"] == 16
        server.start()
        deadline = time.monotonic() + 5.0
        while not all(store.write(keys, payloads).result(WAIT_S)):
            assert time.monotonic() < deadline, "the server that came back was not used again"
            time.sleep(0.05)
        assert store.stats()["tiers"]["redis"]["lane_breaker_state"] == BreakerState.CLOSED
        assert store.read(keys, empty_dests(4, BLOCK)).result(WAIT_S) == [True] * 4
    finally:
        store.close()
        server.close()


def test_a_single_servers_read_passes_one_breaker_set_by_its_options(tmp_path) -> None:
    """The lane's breaker is the tier's, set by its ``breaker_*`` options; the node has none, so after
    ``breaker_failures`` failed reads the server was tried exactly that often, and then not at all."""
    server = refused_server(tmp_path)
    failures, backoff_s, backoff_max_s = 3, 20.0, 40.0  # open for the rest of the test
    store = store_over(
        server.url, breaker_failures=failures, breaker_backoff_s=backoff_s, breaker_backoff_max_s=backoff_max_s
    )
    try:
        breaker = store.lanes[0].breaker
        assert (breaker.failure_threshold, breaker.base_backoff_s, breaker.backoff_max_s) == (
            failures, backoff_s, backoff_max_s,
        )
        key = store.key(b"one block")
        for _ in range(failures + 2):
            assert store.read([key], empty_dests(1, BLOCK)).result(WAIT_S) == [False]
        lane = store.stats()["tiers"]["redis"]
        assert lane["lane_breaker_state"] == BreakerState.OPEN and lane["lane_breaker_opened"] == 1
        assert lane["server_failures"] == failures and lane["lane_open_skips"] == 2
        assert lane["store"]["get_connect"] == failures, "each failed read was one attempt on the server"
        assert not [name for name in lane["store"] if name.startswith("breaker_")], "no second breaker"
        exported = {family.name: family.type for family in text_string_to_metric_families(
            render_prometheus(store.stats()))}
        assert exported["tiercache_tier_lane_breaker_state"] == "gauge"
    finally:
        store.close()
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
            told = CallReport()
            report_calls_into(told)  # what the tier tells its lane's breaker, as a lane would hear it
            out = empty_dests(7, BLOCK)
            assert await reader.get_into(keys, out) == [True, False, False, False, False, False, True]
            assert bytes(out[0]) == bytes(payloads[0]) and bytes(out[6]) == bytes(payloads[6])
            stats = reader.stats()
            assert stats.get("get_bad_magic", 0) == 1 and stats.get("get_bad_checksum", 0) == 1
            assert stats.get("get_truncated", 0) == 1
            assert stats.get("get_wrong_namespace", 0) == 1 and stats.get("get_wrong_key", 0) == 1
            assert stats["misses"] == 5 and told.server_failed is None, "bad values are no server failure"
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
