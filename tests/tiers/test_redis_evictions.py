"""The Redis tier hears its server's own expiries through keyspace notifications, across what a server does.

A server that refuses ``CONFIG SET`` leaves the view best effort (counted, logged
once) and the tier working; a server that restarts is subscribed to again and its
later expiries are heard; ``close`` stops the watcher within its bound.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis

from tiercache.testing.redis_servers import EXPIRED_CHANNEL, random_blocks, remote_context
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 4096
TTL_S = 0.3
WAIT_S = 10.0
"""Upper bound on waiting for a notification or a re-subscription (a hang detector, not a speed judgement)."""
SHORT = {"timeout_s": 0.5, "connect_timeout_s": 0.5, "allow_unbounded": True}


async def open_listened_tier(url: str, heard: list[bytes], **options: object) -> RedisTier:
    """A tier with an eviction listener (the watcher starts only when someone listens)."""
    tier = RedisTier(remote_context(BLOCK), RedisOptions(url=url, **{**SHORT, **options}))
    tier.on_evicted(heard.extend)
    await tier.start()
    return tier


async def eventually(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_server_that_refuses_config_set_leaves_the_tier_working(redis_factory, caplog) -> None:
    server = redis_factory(extra_args=[
        "--user", "default", "off", "--user", "engine", "on", ">pw", "~*", "&*", "+@all", "-config|set",
    ])
    heard: list[bytes] = []
    with caplog.at_level(logging.WARNING):
        tier = await open_listened_tier(server.url, heard, username="engine", password="pw", ttl_s=TTL_S)
    try:
        engine = redis.Redis(host=server.host, port=server.port, username="engine", password="pw")
        assert engine.pubsub_numsub(EXPIRED_CHANNEL) == [(EXPIRED_CHANNEL.encode(), 0)]
        engine.close()
        assert tier.stats()["eviction_watch_refused"] == 1
        assert caplog.text.count("refuses CONFIG notify-keyspace-events") == 1
        keys, payloads = random_blocks(3, BLOCK)
        assert await tier.put(keys, payloads) == [True] * 3
        await asyncio.sleep(3 * TTL_S)
        assert heard == [], "nothing can be heard from a server that was not asked to publish"
    finally:
        await tier.close()


async def test_a_restarted_server_is_subscribed_to_again(redis_factory) -> None:
    server = redis_factory()
    heard: list[bytes] = []
    tier = await open_listened_tier(server.url, heard, ttl_s=TTL_S)
    try:
        assert server.subscribers(EXPIRED_CHANNEL) == 1
        server.restart()  # empty, notification flags reset: the watcher must set them again
        await eventually(lambda: tier.stats().get("eviction_watch_errors", 0) >= 1, "the lost connection went unseen")
        await eventually(lambda: server.subscribers(EXPIRED_CHANNEL) == 1, "never subscribed again")
        keys, payloads = random_blocks(3, BLOCK)
        stored = await tier.put(keys, payloads)
        assert stored == [True] * 3
        await eventually(lambda: set(heard) == set(keys), f"expiries after the restart not heard: {len(heard)} of 3")
    finally:
        await tier.close()


@pytest.mark.parametrize("state", ["running", "stopped"])
async def test_close_is_bounded_whatever_the_server_does(redis_factory, state: str) -> None:
    server = redis_factory()
    tier = await open_listened_tier(server.url, [], ttl_s=TTL_S)
    if state == "stopped":
        server.stop()  # SIGSTOP: the subscription's socket stays open and silent
    try:
        started = time.monotonic()
        await tier.close()
        assert time.monotonic() - started < WAIT_S, "close waited on the watcher without a bound"
    finally:
        server.cont()
