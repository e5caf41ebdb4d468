"""The regional tier on the Redis tier's data path (issue 14 item 4): option names, TLS, force_latest, capacity."""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import REPO
from support.redis_tls import tls_server

from tiercache.blocks.codec import Codec
from tiercache.config import load_config
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.regional import RegionalOptions, RegionalTier, SyncMode
from tiercache.tiers.regional import options as regional_options

BLOCK_BYTES = 4096
FINGERPRINT = bytes(range(16, 32))
OLD_TIMEOUT_MS = 250.0
COUNT = 8
SUBSCRIBE_BOUND_S = 30.0
"""Failure detector only: a subscription not made by then is taken as failed (it normally takes ms)."""
CENTRAL_ONLY: dict[str, Any] = {"central_url": "redis://127.0.0.1:1", "mode": SyncMode.CENTRAL}
"""Options that need no region (never connected to in the option tests)."""
CONFIG_DIR = REPO / "configs"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payloads(tag: int, count: int = COUNT) -> list[memoryview]:
    return [memoryview(bytes([(tag + i) % 256]) * BLOCK_BYTES) for i in range(count)]


async def read(tier: RegionalTier, keys: list[bytes], *, force_latest: bool = False) -> list[bytes | None]:
    dests = [memoryview(bytearray(BLOCK_BYTES)) for _ in keys]
    oks = await tier.get_into(keys, dests, force_latest=force_latest)
    return [bytes(d) if ok else None for d, ok in zip(dests, oks, strict=True)]


async def started(central_url: str, region_url: str, **options: Any) -> RegionalTier:
    opts = RegionalOptions(central_url=central_url, region_url=region_url, **{"invalidate": False, **options})
    tier = RegionalTier(RemoteContext("regional", Codec(FINGERPRINT), BLOCK_BYTES), opts)
    await tier.start()
    return tier


def test_old_option_names_are_accepted_with_a_warning_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(regional_options, "_warned", set())
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning, match="'timeout_s'"):
        first = RegionalOptions(**CENTRAL_ONLY, socket_timeout_ms=OLD_TIMEOUT_MS)
        RegionalOptions(**CENTRAL_ONLY, socket_timeout_ms=OLD_TIMEOUT_MS)
    assert first.timeout_s == first.connect_timeout_s == OLD_TIMEOUT_MS / 1000
    assert first.redis_options(first.central_url).timeout_s == OLD_TIMEOUT_MS / 1000
    logged = [r for r in caplog.records if "socket_timeout_ms" in r.getMessage()]
    assert len(logged) == 1, "the deprecation is logged once per process"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = RegionalOptions(**CENTRAL_ONLY, timeout_s=0.25, ssl=True, username="u")
    assert new.redis_options("redis://127.0.0.1:2").ssl and new.redis_options("redis://127.0.0.1:2").username == "u"


def test_old_option_names_load_from_yaml_with_a_warning(tmp_path: Path) -> None:
    data = yaml.safe_load((CONFIG_DIR / "regional.yaml").read_text())
    (remote,) = [tier for tier in data["tiers"] if tier["type"] == "regional"]
    del remote["options"]["timeout_s"]
    remote["options"]["socket_timeout_ms"] = 300
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(DeprecationWarning):
        config = load_config(path, environ={})
    (options,) = [tier.options for tier in config.tiers if tier.type == "regional"]
    assert options.timeout_s == 0.3


@pytest.mark.parametrize("options", [{}, {"compress": True}, {"stage_reads": True}], ids=["fast", "lz4", "staged"])
async def test_force_latest_serves_current_regional_copies_by_their_header_version(
    redis_factory: Callable[..., RedisServer], options: dict[str, Any]
) -> None:
    """The version of a regional hit comes from the header as the data path received it, on every read path:
    a replicated copy is served from the region, a copy older than central's is not."""
    central, region_a, region_b = redis_factory(), redis_factory(), redis_factory()
    a = await started(central.url, region_a.url, **options)
    b = await started(central.url, region_b.url, **options)
    try:
        keys = [key(i) for i in range(COUNT)]
        await a.put(keys, payloads(1))
        await a.flush()
        assert a.stats()["own_unreplicated"] == 0
        assert await read(a, keys, force_latest=True) == [bytes(p) for p in payloads(1)]
        stats = a.stats()
        assert (stats["regional_hits"], stats["central_reads"]) == (COUNT, 0), stats
        assert stats["region_get_hit"] == COUNT
        await b.put(keys[:2], payloads(9, 2))
        await b.flush()
        expected = [bytes(p) for p in payloads(9, 2) + payloads(1)[2:]]
        assert await read(a, keys, force_latest=True) == expected
        stats = a.stats()
        assert (stats["central_reads"], stats["refreshed"]) == (2, 2), stats
        assert await read(a, keys) == expected, "the refreshed copies serve plain reads"
    finally:
        await a.close()
        await b.close()


async def test_a_region_without_maxmemory_refuses_writes_unless_allowed(
    redis_factory: Callable[..., RedisServer],
) -> None:
    """The Redis tier's capacity check guards the region: writes are queued for central but not stored there."""
    central, region = redis_factory(), redis_factory(maxmemory="0")
    keys = [key(100 + i) for i in range(COUNT)]
    refused = await started(central.url, region.url)
    try:
        assert await refused.put(keys, payloads(3)) == [True] * COUNT  # queued for central
        assert refused.stats()["region_put_refused_unbounded"] == COUNT
        assert await refused.region.read(keys) == [None] * COUNT
    finally:
        await refused.close()
    allowed = await started(central.url, region.url, allow_unbounded=True)
    try:
        assert await allowed.put(keys, payloads(4)) == [True] * COUNT
        assert all(value is not None for value in await allowed.region.read(keys) or [None])
    finally:
        await allowed.close()


async def test_tls_options_reach_both_servers_and_both_planes(
    redis_factory: Callable[..., RedisServer], pki: dict[str, Path]
) -> None:
    """Mutual TLS to central (``ssl: true`` on a redis:// URL) and the region (rediss://): data path, Lua
    commits and pub/sub all verify the server and present the client certificate; without it, misses."""
    central, central_url = tls_server(redis_factory, pki, mutual=True)
    _, region_url = tls_server(redis_factory, pki, mutual=True)
    central_plain = central_url.replace("rediss://", "redis://")
    tls = {"ssl_ca": str(pki["ca"]), "ssl_cert": str(pki["client_cert"]), "ssl_key": str(pki["client_key"])}
    keys = [key(200 + i) for i in range(COUNT)]
    tier = await started(central_plain, region_url, ssl=True, invalidate=True, **tls)
    try:
        assert tier.invalidator is not None
        deadline = time.monotonic() + SUBSCRIBE_BOUND_S
        while central.subscribers(tier.options.channel) == 0:  # pub/sub over TLS, as central counts it
            assert time.monotonic() < deadline, "the invalidator never subscribed"
            await asyncio.sleep(0.01)
        assert await tier.put(keys, payloads(5)) == [True] * COUNT
        await tier.flush()
        stats = tier.stats()
        assert stats["replicated"] == COUNT and stats["region_put_ok"] == COUNT, stats
        assert await read(tier, keys) == [bytes(p) for p in payloads(5)]
        assert await read(tier, keys, force_latest=True) == [bytes(p) for p in payloads(5)]
        await tier.region.delete(keys[:1])
        assert await read(tier, keys[:1]) == [bytes(payloads(5)[0])], "read through from central over TLS"
    finally:
        await tier.close()
    anonymous = await started(central_plain, region_url, ssl=True, ssl_ca=str(pki["ca"]), timeout_s=0.5)
    try:
        assert await read(anonymous, keys) == [None] * COUNT
        stats = anonymous.stats()
        assert stats["region_errors_unreachable"] > 0 and stats["central_errors_unreachable"] > 0, stats
    finally:
        await anonymous.close()
