"""The file tier: atomic writes, validation, GC by capacity and age, stats; and the breaker."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from redis_servers import OTHER_FINGERPRINT, empty_dests, random_blocks, remote_context

from tiercache.breaker import BreakerState, CircuitBreaker
from tiercache.codec import HEADER_SIZE, Codec
from tiercache.config import ConfigError, build_dataclass
from tiercache.tiers import tier_class
from tiercache.tiers.file import STALE_TEMP_AGE_S, FileOptions, FileTier

BLOCK = 32 * 1024
FILE_BYTES = BLOCK + HEADER_SIZE


async def open_tier(path: os.PathLike, **options: object) -> FileTier:
    tier = FileTier(remote_context(BLOCK), FileOptions(path=str(path), **{"max_blocks": 1000, **options}))
    await tier.start()
    return tier


async def test_round_trip_layout_and_stats(tmp_path) -> None:
    tier = await open_tier(tmp_path)
    try:
        keys, payloads = random_blocks(20, BLOCK)
        assert await tier.put(keys, payloads) == [True] * 20
        path = tier.path_of(keys[0])
        hexname = keys[0].hex()
        assert path == tmp_path / hexname[:2] / hexname[2:4] / f"{hexname}.kv"
        assert path.stat().st_size == FILE_BYTES
        out = empty_dests(20, BLOCK)
        assert await tier.get_into(keys, out) == [True] * 20
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
        await tier.delete(keys[:4])
        assert await tier.contains(keys[:5]) == [False] * 4 + [True]
        assert await tier.get_into(keys[:5], out[:5]) == [False] * 4 + [True]
        stats = tier.stats()
        assert stats["put_ok"] == 20 and stats["get_hit"] == 21 and stats["get_miss"] == 4
        assert stats["hits"] == 21 and stats["misses"] == 4
        assert stats["bytes_written"] == 20 * FILE_BYTES and stats["bytes_read"] == 21 * BLOCK
        assert stats["used_blocks"] == 16 and stats["used_bytes"] == 16 * FILE_BYTES
        assert not list(tmp_path.rglob("*.tmp"))
    finally:
        await tier.close()


async def test_bad_files_are_misses(tmp_path) -> None:
    tier = await open_tier(tmp_path, compress=True)
    try:
        keys, payloads = random_blocks(6, BLOCK)
        payloads[5][:] = bytes(BLOCK)
        assert all(await tier.put(keys, payloads))
        assert tier.path_of(keys[5]).stat().st_size < FILE_BYTES // 10
        tier.path_of(keys[0]).write_bytes(os.urandom(FILE_BYTES))
        whole = tier.path_of(keys[1]).read_bytes()
        tier.path_of(keys[1]).write_bytes(whole[: len(whole) // 2])
        tier.path_of(keys[2]).write_bytes(Codec(OTHER_FINGERPRINT).encode_value(keys[2], payloads[2]))
        tier.path_of(keys[3]).write_bytes(whole + b"extra")
        out = empty_dests(6, BLOCK)
        assert await tier.get_into(keys, out) == [False, False, False, False, True, True]
        assert bytes(out[5]) == bytes(BLOCK)
        stats = tier.stats()
        assert stats["get_bad_magic"] == 1 and stats["get_truncated"] == 1
        assert stats["get_wrong_namespace"] == 1 and stats["get_bad_length"] == 1
    finally:
        await tier.close()


async def test_concurrent_writers_of_one_key_leave_a_whole_value(tmp_path) -> None:
    writers = [await open_tier(tmp_path) for _ in range(3)]
    try:
        keys, _ = random_blocks(1, BLOCK)
        values = [random_blocks(1, BLOCK, seed=s)[1] for s in range(3)]
        for _ in range(5):
            await asyncio.gather(*(w.put(keys, v) for w, v in zip(writers, values, strict=True)))
        out = empty_dests(1, BLOCK)
        assert await writers[0].get_into(keys, out) == [True]
        assert bytes(out[0]) in {bytes(v[0]) for v in values}
        assert not list(tmp_path.rglob("*.tmp"))
    finally:
        for writer in writers:
            await writer.close()


async def test_gc_by_capacity_keeps_recently_used(tmp_path) -> None:
    tier = await open_tier(tmp_path, max_blocks=None, max_bytes=10 * FILE_BYTES, gc_low_watermark=0.5)
    try:
        keys, payloads = random_blocks(16, BLOCK)
        for key, payload in zip(keys[:10], payloads[:10], strict=True):
            assert await tier.put([key], [payload]) == [True]
            await asyncio.sleep(0.01)  # distinct mtimes
        assert await tier.get_into(keys[:1], empty_dests(1, BLOCK)) == [True]  # touch: most recent
        assert await tier.put(keys[10:12], payloads[10:12]) == [True, True]
        present = await tier.contains(keys[:12])
        assert present[0] and present[10] and present[11]
        assert sum(present) <= 5 + 2
        files = list(tmp_path.rglob("*.kv"))
        assert sum(f.stat().st_size for f in files) <= 10 * FILE_BYTES
        assert tier.stats()["gc_removed_blocks"] >= 5
        assert await tier.put(keys, payloads) == [False] * 16  # larger than the whole tier
        assert tier.stats()["put_full"] == 16
    finally:
        await tier.close()


async def test_gc_by_age_and_stale_temp_files(tmp_path) -> None:
    tier = await open_tier(tmp_path, max_age_s=60.0)
    try:
        keys, payloads = random_blocks(3, BLOCK)
        await tier.put(keys, payloads)
        old = time.time() - 120
        os.utime(tier.path_of(keys[0]), (old, old))
        stale = tier.path_of(keys[1]).with_name(".dead-writer.tmp")
        stale.write_bytes(b"partial")
        long_ago = time.time() - STALE_TEMP_AGE_S - 1
        os.utime(stale, (long_ago, long_ago))
        await tier.gc()
        assert await tier.contains(keys) == [False, True, True]
        assert not stale.exists()
        assert tier.stats()["gc_expired"] == 1 and tier.stats()["gc_stale_temps"] == 1
    finally:
        await tier.close()


def test_file_options_need_a_bound() -> None:
    options_type = tier_class("file").Options
    built = build_dataclass(options_type, {"path": "/x", "max_bytes": "1GiB"}, "t.yaml", "o")
    assert built.max_bytes == 2**30
    with pytest.raises(ConfigError, match="bounded"):
        build_dataclass(options_type, {"path": "/x"}, "t.yaml", "o")


def test_breaker_opens_backs_off_and_recovers() -> None:
    now = [0.0]
    breaker = CircuitBreaker(2, 1.0, 3.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.allow() and breaker.state is BreakerState.CLOSED
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    now[0] = 1.2
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and breaker.backoff_s == 2.0
    now[0] = 3.5
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.backoff_s == 1.0
    assert breaker.opened == 2 and breaker.rejected == 2
