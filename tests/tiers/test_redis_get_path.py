"""The Redis tier's GET fast path and continuous pipelining, edge case by edge case, on a real server.

Every value of the expected length is received with one ``recvmsg_into`` and its
header compared as bytes; everything else must take the general path and come
out exactly as before: deleted keys and misses at a batch's last positions,
values of another length (one whose length line looks like the expected one),
a valid value stored under another key, a ``-WRONGTYPE`` error, a corrupt
payload, another namespace. The good values around them must be served intact.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import HEADER_SIZE, DecodeStatus
from tiercache.testing.redis_servers import OTHER_FINGERPRINT, empty_dests, random_blocks, remote_context
from tiercache.tiers.base import CallReport, report_calls_into
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 64 * 1024
SHORT = {"timeout_s": 2.0, "connect_timeout_s": 2.0}
COUNT = 16


async def open_tier(url: str, **options: object) -> RedisTier:
    tier = RedisTier(remote_context(BLOCK), RedisOptions(url=url, **{**SHORT, **options}))
    await tier.start()
    return tier


def tamper(server, tier: RedisTier, keys: list[bytes], payloads: list[memoryview]) -> dict[int, str]:
    """Spoil some stored values; the expected outcome per spoiled position."""
    client = redis.Redis(host=server.host, port=server.port)
    try:
        name = [tier.redis_key(k) for k in keys]
        value = [client.get(n) for n in name]
        client.delete(name[1])
        client.set(name[2], Codec(remote_context(BLOCK).codec.fingerprint).encode_value(keys[2], payloads[2][:-8]))
        # Length lines that start like the expected "$65608\r\n": "$6560\r\n" and "$656080\r\n".
        client.set(name[3], value[3][:6560])
        client.set(name[4], value[4] * 10)
        client.set(name[5], value[6])  # a valid value of another key
        client.delete(name[7])
        client.lpush(name[7], b"x")  # GET answers -WRONGTYPE
        flipped = bytearray(value[8])
        flipped[HEADER_SIZE + 100] ^= 0xFF
        client.set(name[8], bytes(flipped))
        client.set(name[9], Codec(OTHER_FINGERPRINT).encode_value(keys[9], payloads[9]))
        client.delete(name[COUNT - 2], name[COUNT - 1])  # misses at the batch's last positions
    finally:
        client.close()
    return {
        1: "miss", 2: "bad_length", 3: "truncated", 4: "bad_length", 5: "wrong_key", 7: "server_error",
        8: "bad_checksum", 9: "wrong_namespace", COUNT - 2: "miss", COUNT - 1: "miss",
    }


@pytest.mark.parametrize("options", [{}, {"stage_reads": True}, {"connections": 2}, {"pipeline_bytes": BLOCK}])
async def test_every_edge_case_is_exact_and_the_rest_is_served(redis_server, options: dict) -> None:
    writer = await open_tier(redis_server.url)
    tier = await open_tier(redis_server.url, **options)
    keys, payloads = random_blocks(COUNT, BLOCK)
    told = CallReport()
    report_calls_into(told)  # what the tier tells its lane's breaker, as a lane would hear it
    try:
        for _ in range(2):  # the second round starts with whatever the first left buffered
            assert all(await writer.put(keys, payloads))  # the first round deleted the invalid values
            spoiled = tamper(redis_server, writer, keys, payloads)
            out = empty_dests(COUNT, BLOCK)
            results = await tier.get_into(keys, out)
            assert results == [i not in spoiled for i in range(COUNT)]
            for i in range(COUNT):
                if i not in spoiled:
                    assert bytes(out[i]) == bytes(payloads[i]), i
            await tier.settle()
        stats = tier.stats()
        expected: dict[str, int] = {}
        for outcome in spoiled.values():
            expected[f"get_{outcome}"] = expected.get(f"get_{outcome}", 0) + 2
        for name, count in expected.items():
            assert stats.get(name) == count, (name, stats)
        assert stats["get_hit"] == 2 * (COUNT - len(spoiled))
        judged = [DecodeStatus(o) for o in spoiled.values() if o not in ("miss", "server_error")]
        assert stats["invalid_deleted"] == 2 * sum(status.damaged for status in judged)
        assert stats["invalid_kept"] == 2 * sum(not status.damaged for status in judged) == 2  # the other namespace
        assert told.server_failed is None and stats["connects"] == tier.connections
    finally:
        await writer.close()
        await tier.close()


async def test_loads_outstanding_share_one_connection_and_misses_end_each(redis_server) -> None:
    tier = await open_tier(redis_server.url)
    try:
        keys, payloads = random_blocks(4 * COUNT, BLOCK)
        assert all(await tier.put(keys[: 3 * COUNT], payloads[: 3 * COUNT]))
        batches = [keys[i * COUNT : (i + 1) * COUNT] for i in range(4)]
        # every batch ends in keys that were never stored (the last batch is all misses)
        batches = [b[: COUNT - 2] + keys[3 * COUNT + 2 * i : 3 * COUNT + 2 * i + 2] for i, b in enumerate(batches)]
        outs = [empty_dests(COUNT, BLOCK) for _ in batches]
        results = await asyncio.gather(*(tier.get_into(b, o) for b, o in zip(batches, outs, strict=True)))
        for i, result in enumerate(results):
            stored = i < 3
            assert result == [stored] * (COUNT - 2) + [False, False]
        for i in range(3):
            for j in range(COUNT - 2):
                assert bytes(outs[i][j]) == bytes(payloads[i * COUNT + j])
        stats = tier.stats()
        assert stats["connects"] == 1 and tier.connections == 1
        assert stats["get_hit"] == 3 * (COUNT - 2) and stats["get_miss"] == COUNT + 6
    finally:
        await tier.close()


async def test_one_io_thread_per_connection_and_none_after_close(redis_server) -> None:
    tier = await open_tier(redis_server.url, connections=2)
    try:
        keys, payloads = random_blocks(COUNT, BLOCK)
        for _ in range(3):
            assert all(await tier.put(keys, payloads))
            assert all(await tier.get_into(keys, empty_dests(COUNT, BLOCK)))
        names = [t.name for t in threading.enumerate() if t.name.startswith(f"tiercache-{tier.name}-")]
        assert len(names) == 2, names
    finally:
        await tier.close()
    for thread in threading.enumerate():
        if thread.name.startswith(f"tiercache-{tier.name}-"):
            thread.join(5.0)  # close() has returned: the thread is on its way out
            assert not thread.is_alive(), thread.name


async def test_puts_share_one_connection_and_reads_spread_over_all(redis_server) -> None:
    """Put calls outstanding together go down one connection (a server stores large values faster from one
    query buffer than from two); a read of enough keys is spread over every connection."""
    tier = await open_tier(redis_server.url, connections=2)
    try:
        keys, payloads = random_blocks(4 * COUNT, BLOCK)
        batches = [slice(start, start + COUNT) for start in range(0, 4 * COUNT, COUNT)]
        stored = await asyncio.gather(*(tier.put(keys[batch], payloads[batch]) for batch in batches))
        assert all(all(oks) for oks in stored)
        assert tier.stats()["connects"] == 1  # the start's PING opened it; every put used it
        outs = empty_dests(4 * COUNT, BLOCK)
        assert all(await tier.get_into(keys, outs))
        assert [bytes(out) for out in outs] == [bytes(payload) for payload in payloads]
        assert tier.stats()["connects"] == 2
    finally:
        await tier.close()


def test_default_connections_and_window_follow_the_value_size() -> None:
    small = RedisTier(remote_context(BLOCK), RedisOptions())
    large = RedisTier(remote_context(2 << 20), RedisOptions())
    assert small.connections == 1 and large.connections == 2
    assert small.window == 32 and large.window == 3
    assert RedisTier(remote_context(BLOCK), RedisOptions(connections=3, pipeline_bytes=BLOCK)).window == 1
