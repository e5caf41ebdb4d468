"""A reader that cannot verify a value leaves it alone (issue 20, item 6), on a real Redis.

A namespace written with ``model.secret_env``'s secret is read by a reader with
a wrong secret and by one with none: their values are misses, and not one of
them is deleted, so the writer's own reader still gets every block. A value
the writer's reader can prove damaged (its own key id, a payload that no longer
matches the MAC) is still deleted, so the next store rewrites it.
"""

from __future__ import annotations

import redis

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.testing.redis_servers import FINGERPRINT, empty_dests, random_blocks
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 16 * 1024
COUNT = 128
SECRET = b"the writer's namespace secret..."
WRONG_SECRET = b"a co-tenant's other secret......"


async def open_tier(url: str, codec: Codec, **options: object) -> RedisTier:
    tier = RedisTier(RemoteContext("redis", codec, BLOCK), RedisOptions(url=url, timeout_s=2.0, **options))
    await tier.start()
    return tier


async def test_readers_without_the_secret_leave_every_value(redis_server) -> None:
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    writer = await open_tier(redis_server.url, Codec(FINGERPRINT, secret=SECRET))
    try:
        keys, payloads = random_blocks(COUNT, BLOCK, seed=6)
        assert all(await writer.put(keys, payloads))
        names = [writer.redis_key(key) for key in keys]
        for codec in (Codec(FINGERPRINT, secret=WRONG_SECRET), Codec(FINGERPRINT)):
            for stage_reads in (False, True):
                reader = await open_tier(redis_server.url, codec, stage_reads=stage_reads)
                assert await reader.get_into(keys, empty_dests(COUNT, BLOCK)) == [False] * COUNT
                await reader.settle()
                left = sum(client.exists(name) for name in names)
                assert left == COUNT, f"a reader without the writer's secret deleted {COUNT - left} of {COUNT} values"
                assert reader.stats()["invalid_deleted"] == 0 and reader.stats()["invalid_kept"] == COUNT
                await reader.close()
        out = empty_dests(COUNT, BLOCK)
        assert await writer.get_into(keys, out) == [True] * COUNT
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]

        damaged = bytearray(client.get(names[7]))
        damaged[HEADER_SIZE + 3] ^= 0x01  # one payload bit: the MAC under the writer's own key no longer holds
        client.set(names[7], bytes(damaged))
        owner = await open_tier(redis_server.url, Codec(FINGERPRINT, secret=SECRET))
        results = await owner.get_into(keys, empty_dests(COUNT, BLOCK))
        assert results == [index != 7 for index in range(COUNT)]
        await owner.settle()
        assert owner.stats()["get_bad_mac"] == 1 and owner.stats()["invalid_deleted"] == 1
        assert client.exists(names[7]) == 0 and sum(client.exists(name) for name in names) == COUNT - 1
        await owner.close()
    finally:
        client.close()
        await writer.close()


async def test_a_keyed_file_tier_serves_the_batches_it_wrote(tmp_path) -> None:
    """The file tier's batched read validates keyed values with the codec (it took every MAC for a bad format)."""
    from tiercache.tiers.file import FileOptions, FileTier

    def open_file_tier() -> FileTier:
        return FileTier(RemoteContext("file", Codec(FINGERPRINT, secret=SECRET), BLOCK), FileOptions(
            path=str(tmp_path), max_blocks=256
        ))

    writer = open_file_tier()
    await writer.start()
    keys, payloads = random_blocks(8, BLOCK, seed=8)
    try:
        assert await writer.put(keys, payloads) == [True] * 8
    finally:
        await writer.close()
    reader = open_file_tier()
    await reader.start()
    try:
        out = empty_dests(8, BLOCK)
        assert await reader.get_into(keys, out) == [True] * 8, reader.stats()
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
    finally:
        await reader.close()
