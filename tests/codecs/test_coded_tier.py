"""A remote tier at lossy levels, on a real Redis: what each reader loads, what two fleets do to each other, what a
damaged value becomes, and how an adaptive fetch picks each chunk's level."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from support.coded_tiers import view, write_and_read

from tiercache.blocks.value_format import HEADER_SIZE, DecodeStatus
from tiercache.codecs.choice import PRIOR_DECODE_BYTES_PER_S, LevelChooser
from tiercache.codecs.levels import Level
from tiercache.config import config_from_dict
from tiercache.remote.build import build_tier, model_namespace
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import Presence, RemoteTier
from tiercache.tiers.coded import PROBE_BLOCKS, CodedTier

BLOCK_TOKENS = 16
HEAD_DIM = 64


def remote(url: str, codec: dict[str, Any] | None, sample: torch.Tensor, kind: str = "redis") -> RemoteTier:
    """A Redis tier (``url``; ``kind`` file: a file tier in the directory ``url``) of a float16 layout of
    ``sample``'s shape, with ``codec`` (None: the default, exact)."""
    layers, _, _, channels = sample.shape
    layout = {"num_layers": layers, "num_kv_heads": channels // HEAD_DIM, "head_dim": HEAD_DIM,
              "dtype": "float16", "block_size": BLOCK_TOKENS, "memory": "layer_major"}
    options = {"url": url} if kind == "redis" else {"path": url, "max_bytes": "64MiB"}
    tier: dict[str, Any] = {"name": kind, "type": kind, "options": options}
    if codec is not None:
        tier["codec"] = codec
    tiers = [{"type": "gpu", "capacity_blocks": 8, "options": {"device": "cpu"}}, tier]
    config = config_from_dict({"model": {"id": "codec-test"}, "layout": layout, "tiers": tiers}, environ={})
    return build_tier(config.tiers[1], model_namespace(config)[1], config.layout.bytes_per_block, config.layout)


def blocks_of(sample: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` float16 layer-major blocks ``[layers, 2, tokens, heads, dim]`` of ``sample``."""
    layers, _, _, channels = sample.shape
    shaped = sample.reshape(layers, 2, -1, channels // HEAD_DIM, HEAD_DIM).half()
    return [shaped[:, :, i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS].contiguous() for i in range(count)]


def relative_error(decoded: torch.Tensor, block: torch.Tensor) -> float:
    return float((decoded.float() - block.float()).norm() / block.float().norm())


def test_a_value_written_at_one_level_is_read_by_an_adaptive_reader(
    redis_server: RedisServer, real_kv: list[torch.Tensor], tables_file: Path
) -> None:
    blocks = blocks_of(real_kv[0], 3)
    writer = remote(redis_server.url, {"levels": ["int8"]}, real_kv[0])
    reader = remote(redis_server.url, {"levels": ["compact", "int8"], "adaptive": True, "tables": str(tables_file)},
                    real_kv[0])
    decoded = asyncio.run(write_and_read(writer, reader, blocks))
    pairs = zip(decoded, blocks, strict=True)
    assert all(slot is not None and relative_error(slot, block) < 0.02 for slot, block in pairs)
    assert isinstance(reader, CodedTier) and reader.stats()["level_int8_blocks"] == len(blocks)


def test_a_file_tier_stores_and_reads_every_level(real_kv: list[torch.Tensor], tables_file: Path,
                                                   tmp_path: Path) -> None:
    blocks = blocks_of(real_kv[1], 2)
    codec = {"levels": ["compact", "int8", "exact"], "tables": str(tables_file)}
    tier = remote(str(tmp_path), codec, real_kv[1], kind="file")
    decoded = asyncio.run(write_and_read(tier, tier, blocks))
    pairs = zip(decoded, blocks, strict=True)
    assert all(slot is not None and 0 < relative_error(slot, block) < 0.05 for slot, block in pairs)
    exact = remote(str(tmp_path), None, real_kv[1], kind="file")
    assert all(slot is not None and torch.equal(slot, block)
               for slot, block in zip(asyncio.run(write_and_read(exact, exact, blocks)), blocks, strict=True))


def test_a_lossy_value_is_invisible_to_an_exact_reader(
    redis_server: RedisServer, redis_client: redis.Redis, real_kv: list[torch.Tensor], tables_file: Path
) -> None:
    blocks = blocks_of(real_kv[0], 2)
    writer = remote(redis_server.url, {"levels": ["compact"], "tables": str(tables_file)}, real_kv[0])
    exact = remote(redis_server.url, None, real_kv[0])
    assert not isinstance(exact, CodedTier) and exact.codec.coding is None
    assert asyncio.run(write_and_read(writer, exact, blocks)) == [None, None]
    # Even a lossy value under the block's own key (a fleet misconfigured by hand) is not loaded, nor deleted.
    (name,) = [key for key in redis_client.keys("tiercache:*")][:1]
    value = redis_client.get(name)
    redis_client.set(b"tiercache:" + (bytes([0]) * 16).hex().encode(), value)
    slot = torch.zeros_like(blocks[0])

    async def read() -> list[bool]:
        await exact.start()
        try:
            return await exact.get_into([bytes([0]) * 16], [view(slot)])
        finally:
            await exact.close()

    assert asyncio.run(read()) == [False] and (slot == 0).all()
    assert exact.stats().get("get_" + DecodeStatus.LOSSY.value) == 1
    assert redis_client.exists(b"tiercache:" + (bytes([0]) * 16).hex().encode())


def test_two_fleets_with_different_levels_never_touch_each_others_values(
    redis_server: RedisServer, redis_client: redis.Redis, real_kv: list[torch.Tensor], tables_file: Path
) -> None:
    blocks = blocks_of(real_kv[0], 2)
    exact = remote(redis_server.url, None, real_kv[0])
    compact = remote(redis_server.url, {"levels": ["compact"], "tables": str(tables_file)}, real_kv[0])
    assert asyncio.run(write_and_read(exact, exact, blocks))[0] is not None
    before = {name: redis_client.get(name) for name in redis_client.keys("tiercache:*")}
    assert asyncio.run(write_and_read(compact, compact, blocks))[0] is not None
    after = {name: redis_client.get(name) for name in redis_client.keys("tiercache:*")}
    assert len(after) == 2 * len(before) and all(after[name] == value for name, value in before.items())

    async def delete() -> None:
        await compact.start()
        await compact.delete([bytes([i]) * 16 for i in range(len(blocks))])
        await compact.close()

    asyncio.run(delete())
    assert {name: redis_client.get(name) for name in redis_client.keys("tiercache:*")} == before


def test_a_damaged_compressed_value_is_a_miss_and_is_removed(
    redis_server: RedisServer, redis_client: redis.Redis, real_kv: list[torch.Tensor], tables_file: Path
) -> None:
    blocks = blocks_of(real_kv[0], 1)
    tier = remote(redis_server.url, {"levels": ["compact"], "tables": str(tables_file)}, real_kv[0])
    assert asyncio.run(write_and_read(tier, tier, blocks))[0] is not None
    (name,) = redis_client.keys("tiercache:*")
    damaged = bytearray(redis_client.get(name))
    damaged[HEADER_SIZE + 100] ^= 0x10
    redis_client.set(name, bytes(damaged))
    slot = torch.full_like(blocks[0], 3)

    async def read() -> list[bool]:
        await tier.start()
        try:
            found = await tier.contains([bytes([0]) * 16])
            assert found == [Presence.HELD]
            oks = await tier.get_into([bytes([0]) * 16], [view(slot)])
            await tier.settle()
            return oks
        finally:
            await tier.close()

    assert asyncio.run(read()) == [False]
    assert (slot == 3).all(), "a damaged value was decoded into the slot"
    assert not redis_client.exists(name)


RAW_BLOCK = 368_640
"""A float16 block of SmolLM2 (30 layers x 2 x 16 tokens x 192 channels x 2 bytes)."""
WIRE = {Level.EXACT: RAW_BLOCK, Level.INT8: RAW_BLOCK / 1.98, Level.COMPACT: RAW_BLOCK / 3.13}


@pytest.mark.parametrize(("bytes_per_s", "expected"), [(1e10, Level.EXACT), (3e8, Level.INT8), (1e6, Level.COMPACT)])
def test_each_chunks_level_follows_the_throughput_the_link_delivered_and_counts_decode_time(
    bytes_per_s: float, expected: Level
) -> None:
    chooser = LevelChooser(list(Level), WIRE, RAW_BLOCK)
    for elapsed in (0.01, 0.02, 0.04, 0.08):  # a fetch's chunks so far, over the link's throughput
        chooser.delivered(elapsed * bytes_per_s, elapsed)
    assert chooser.choose(4, recompute_seconds=None) is expected
    assert chooser.choose(4, recompute_seconds=1e-9) is None, "recompute wins when every level arrives later"


def test_a_fast_link_never_picks_a_level_whose_decode_is_slower_than_the_link() -> None:
    chooser = LevelChooser([Level.EXACT, Level.COMPACT], WIRE, RAW_BLOCK)
    chooser.delivered(1.25e9, 1.0)  # 10 Gbit/s: the link moves raw KV faster than compact decodes it
    chooser.decoded(Level.COMPACT, 4 * RAW_BLOCK, 4 * RAW_BLOCK / 4e7)  # this process decodes compact at 40 MB/s
    assert chooser.decode_rate[Level.COMPACT] == pytest.approx(4e7)
    assert chooser.choose(8, recompute_seconds=None) is Level.EXACT


def test_a_chunks_latency_counts_against_recomputing_it() -> None:
    chooser = LevelChooser([Level.COMPACT], WIRE, RAW_BLOCK)
    chooser.delivered(1.25e9, 1.0)
    decode_s = RAW_BLOCK / PRIOR_DECODE_BYTES_PER_S[Level.COMPACT]
    chooser.observe(Level.COMPACT, 1, 0.5 + WIRE[Level.COMPACT] / 1.25e9 + decode_s)  # half a second of round trip
    assert chooser.latency_s == pytest.approx(0.5, rel=0.01)
    assert chooser.choose(1, recompute_seconds=0.2) is None
    assert chooser.choose(1, recompute_seconds=2.0) is Level.COMPACT


def test_a_slow_links_first_chunk_teaches_its_throughput_not_a_latency() -> None:
    chooser = LevelChooser([Level.INT8, Level.COMPACT], WIRE, RAW_BLOCK)
    assert not chooser.measured
    probe_s = 4 * WIRE[Level.INT8] / 12.5e6  # four int8 blocks over 100 Mbit/s, the link's first timed read
    chooser.observe(Level.INT8, 4, probe_s)
    chooser.delivered(4 * WIRE[Level.INT8], probe_s)
    assert chooser.measured and chooser.latency_s == 0 and chooser.throughput == pytest.approx(12.5e6)
    assert chooser.choose(16, recompute_seconds=None) is Level.COMPACT


def test_a_presence_checks_round_trip_is_the_latency_a_first_chunks_throughput_is_net_of() -> None:
    chooser = LevelChooser([Level.EXACT, Level.INT8, Level.COMPACT], WIRE, RAW_BLOCK)
    for seconds in (0.030, 0.020, 0.025):
        chooser.round_trip(seconds)
    assert chooser.latency_s == pytest.approx(0.020), "the shortest round trip is the latency"
    probe_s = 0.020 + 2 * WIRE[Level.INT8] / 1.25e9  # two int8 blocks over 10 Gbit/s behind a 20 ms round trip
    chooser.observe(Level.INT8, 2, probe_s)
    chooser.delivered(2 * WIRE[Level.INT8], probe_s)
    assert chooser.throughput == pytest.approx(1.25e9, rel=0.01), "the round trip is no part of the throughput"
    assert chooser.choose(16, recompute_seconds=None) is Level.INT8  # as on a 10 Gbit/s link with no delay
    blind = LevelChooser([Level.EXACT, Level.INT8, Level.COMPACT], WIRE, RAW_BLOCK)
    blind.observe(Level.INT8, 2, probe_s)
    blind.delivered(2 * WIRE[Level.INT8], probe_s)
    assert blind.choose(16, recompute_seconds=None) is Level.COMPACT, "without it the round trip reads as a slow link"
    chooser.round_trip(0.001)
    assert chooser.latency_s == pytest.approx(0.020), "once a read has timed the link, chunks teach the latency"


def test_an_untimed_links_probe_is_read_even_where_recomputing_looks_cheaper(
    redis_server: RedisServer, real_kv: list[torch.Tensor]
) -> None:
    blocks = blocks_of(real_kv[0], PROBE_BLOCKS + 1)
    writer = remote(redis_server.url, {"levels": ["int8"]}, real_kv[0])
    reader = remote(redis_server.url, {"levels": ["int8", "exact"], "adaptive": True}, real_kv[0])
    assert isinstance(reader, CodedTier)
    reader.recompute_seconds = lambda tokens: 1e-9  # prefill looks free: every chunk chosen is recomputed
    decoded = asyncio.run(write_and_read(writer, reader, blocks))
    assert [slot is not None for slot in decoded] == [True] * PROBE_BLOCKS + [False] * (len(blocks) - PROBE_BLOCKS)
    stats = reader.stats()
    assert stats["level_int8_blocks"] == PROBE_BLOCKS and stats["level_recompute_chunks"] == 1
