"""The Redis tier over a real 3-node Redis Cluster: keys across slots, a node down."""

from __future__ import annotations

import asyncio
import time

import redis

from tiercache.testing.redis_servers import empty_dests, random_blocks, remote_context
from tiercache.tiers.base import Presence
from tiercache.tiers.redis import RedisOptions, RedisTier, key_slot

HELD, ABSENT = Presence.HELD, Presence.ABSENT

BLOCK = 16 * 1024
FAST = {
    "cluster": True,
    "timeout_s": 0.3,
    "connect_timeout_s": 0.3,
    "breaker_failures": 1,
    "breaker_backoff_s": 0.2,
    "breaker_backoff_max_s": 0.4,
}


async def test_cluster_round_trip_and_node_down(redis_cluster) -> None:
    tier = RedisTier(remote_context(BLOCK), RedisOptions(url=redis_cluster.url, **FAST))
    await tier.start()
    try:
        keys, payloads = random_blocks(60, BLOCK)
        assert len({key_slot(tier.redis_key(k)) for k in keys}) == 60
        assert await tier.put(keys, payloads) == [True] * 60
        assert tier.stats()["nodes"] == 3
        counts = [redis.Redis(host=n.host, port=n.port).dbsize() for n in redis_cluster.nodes]
        assert sum(counts) == 60 and min(counts) > 0, counts
        out = empty_dests(60, BLOCK)
        assert await tier.get_into(keys, out) == [True] * 60
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
        assert await tier.contains(keys) == [HELD] * 60
        await tier.delete(keys[:5])
        assert await tier.contains(keys[:6]) == [ABSENT] * 5 + [HELD]

        down = redis_cluster.nodes[1]
        owned_by_down = redis.Redis(host=down.host, port=down.port)
        lost = {i for i, k in enumerate(keys) if owned_by_down.execute_command(
            "CLUSTER", "COUNTKEYSINSLOT", key_slot(tier.redis_key(k))) > 0}
        down.kill()
        results = await tier.get_into(keys, empty_dests(60, BLOCK))
        assert {i for i, ok in enumerate(results) if not ok} == lost | set(range(5))
        stats = tier.stats()
        assert stats["breaker_open_nodes"] == 1
        assert stats.get("get_connection", 0) + stats.get("get_connect", 0) > 0

        down.restart()
        deadline = time.monotonic() + 5
        while not all(await tier.put([keys[i] for i in lost], [payloads[i] for i in lost])):
            assert time.monotonic() < deadline, "the restarted node was not used again"
            await asyncio.sleep(0.1)
        assert await tier.get_into(keys[5:], empty_dests(55, BLOCK)) == [True] * 55
    finally:
        await tier.close()


async def test_cluster_unreachable_at_start_is_misses(tmp_path) -> None:
    options = RedisOptions(url="redis://127.0.0.1:1", **FAST)
    tier = RedisTier(remote_context(BLOCK), options)
    await tier.start()
    try:
        keys, payloads = random_blocks(3, BLOCK)
        assert await tier.put(keys, payloads) == [False] * 3
        assert await tier.get_into(keys, empty_dests(3, BLOCK)) == [False] * 3
        assert tier.stats()["get_unrouted"] == 3
    finally:
        await tier.close()
