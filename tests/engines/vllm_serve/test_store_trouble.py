"""A prefill server (kv_producer) writes, a decode server (kv_consumer) reads; Redis in trouble under each.

The producer answers the prompts the consumer reads (they land in Redis, which
saves them), never loads, answers two more while Redis is frozen, then killed
(its stores fail), and stops. The consumer loads, never stores, so Redis
changes only by this module's hand, and what the consumer could not load stays
out of its CPU tier: asked again once Redis is back, a prompt loads from Redis.
Both run without vLLM's own prefix cache. Redis frozen (SIGSTOP), killed (and
back with its saved data), or serving damaged values: every request is answered
as the baseline, nothing raises in the engine, and the prompt loads again once
Redis is whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from support.vllm_serving import (
    Counted,
    ask,
    log_problems,
    redis_config,
    redis_store,
    retry,
    reusable,
    serving,
    settled,
    wait_until,
)

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.server_formats import ServerMetrics
from tiercache.testing.vllm_server import VllmServer

PRODUCED = ("pd", "stopped", "killed", "corrupted")
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
WHOLE = reusable(1500)
"""The tokens a consumer loads of any of this module's 1500-token prompts."""
RETRIES = 10
"""How often a prompt is asked again (a second apart) while Redis comes back (the connection and breaker recover)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_store(tmp_path_factory.mktemp("pd-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def client(store: RedisServer) -> Iterator[redis.Redis]:
    connection = redis.Redis(host=store.host, port=store.port)
    yield connection
    connection.close()


@dataclass(frozen=True)
class Producer:
    answers: dict[str, list[int]]
    """Its answers: the prompts it produced, ``pd`` again, and those asked while Redis was frozen and killed."""
    metrics: ServerMetrics
    """Its counters once the prompts it produced were asked (before the trouble)."""
    landed: bool
    """Whether Redis held every block it stored before the trouble."""
    healthy: list[bool]
    """Whether it answered /health while Redis was frozen, then killed."""
    problems: list[str]


@pytest.fixture(scope="module")
def producer(model_dirs: dict[str, Path], logs: Path, baseline: dict[str, list[int]], store: RedisServer,
             client: redis.Redis) -> Producer:
    """The producer answers this module's prompts (they land in Redis, which saves them), then two more while
    Redis is frozen and killed (its stores fail), and stops; Redis comes back with what it saved."""
    config = redis_config(store.url, role="kv_producer")
    with serving(model_dirs["seed0"], logs / "producer.log", kv_transfer_config=config, args=NO_PREFIX_CACHE) as server:
        answers = {name: ask(server, name) for name in PRODUCED}
        answers["pd again"] = ask(server, "pd")
        metrics = settled(server)
        stored = metrics.total("vllm:tiercache_stored_blocks_total")
        landed = wait_until(lambda: client.dbsize() == stored, timeout_s=30)
        store.cli("SAVE")
        healthy = []
        for name, trouble, back in (("writer_stopped", store.stop, store.cont),
                                    ("writer_killed", store.kill, store.restart)):
            trouble()
            try:
                answers[name] = ask(server, name)
                healthy.append(server.healthy())
            finally:
                back()
        problems = log_problems(server)
    return Producer(answers, metrics, landed, healthy, problems)


@pytest.fixture(scope="module")
def consumer(model_dirs: dict[str, Path], logs: Path, producer: Producer, store: RedisServer) -> Iterator[VllmServer]:
    config = redis_config(store.url, role="kv_consumer")
    with serving(model_dirs["seed0"], logs / "consumer.log", kv_transfer_config=config, args=NO_PREFIX_CACHE) as server:
        yield server


def test_producer_stores_and_never_loads(producer):
    metrics = producer.metrics
    assert metrics.total("vllm:external_prefix_cache_hits_total") == 0  # pd asked twice, no prefix cache
    assert metrics.total("vllm:tiercache_lookups_total") == 0
    assert metrics.total("vllm:tiercache_stored_blocks_total") > 0
    assert producer.landed  # every stored block reached Redis


def test_producer_answers_while_redis_is_in_trouble(producer, baseline):
    """Its stores fail while Redis is frozen, then killed: it answers each request as the baseline, stays healthy,
    and nothing raises in the engine."""
    assert set(producer.answers) == {*PRODUCED, "pd again", "writer_stopped", "writer_killed"}
    assert producer.answers == {name: baseline[name.removesuffix(" again")] for name in producer.answers}
    assert producer.healthy == [True, True]
    assert producer.problems == []


def test_consumer_loads_and_never_stores(consumer, baseline, client):
    keys = client.dbsize()
    for tier in ("redis", "cpu"):  # the second time from its CPU tier, which kept what it read
        with Counted(consumer) as seen:
            assert ask(consumer, "pd") == baseline["pd"]
        assert seen.external == WHOLE
        assert seen.tiercache("hit_blocks", tier=tier) == WHOLE // 32
    assert client.dbsize() == keys
    assert settled(consumer).total("vllm:tiercache_stored_blocks_total") == 0


def _ask_counting(consumer: VllmServer, name: str, baseline: dict[str, list[int]]) -> int:
    """Ask ``name``, check the answer, return the tokens loaded."""
    with Counted(consumer) as seen:
        answer = ask(consumer, name)
    assert answer == baseline[name]
    return seen.external


def _loads_again(consumer: VllmServer, name: str, baseline: dict[str, list[int]]) -> None:
    loads = retry(lambda: _ask_counting(consumer, name, baseline), tries=RETRIES, pause_s=1.0)
    assert loads[-1] == WHOLE, loads


def test_redis_frozen(consumer, baseline, store):
    store.stop()
    try:
        assert _ask_counting(consumer, "stopped", baseline) == 0
        assert consumer.healthy()
    finally:
        store.cont()
    _loads_again(consumer, "stopped", baseline)


def test_redis_killed_then_back(consumer, baseline, store):
    store.cli("SAVE")  # it comes back with its data, as a server that persists does
    store.kill()
    try:
        assert _ask_counting(consumer, "killed", baseline) == 0
        assert consumer.healthy()
    finally:
        store.restart()
    _loads_again(consumer, "killed", baseline)


def _damaged(value: bytes, k: int) -> bytes:
    """Four kinds of damage: noise of the same length, the first half, the last byte flipped, a short word."""
    return [os.urandom(len(value)), value[: len(value) // 2], value[:-1] + bytes([value[-1] ^ 0xFF]), b"garbage"][k % 4]


def test_damaged_values(consumer, baseline, client):
    good = {key: client.get(key) for key in sorted(client.keys("*"))}
    assert good
    for k, (key, value) in enumerate(good.items()):
        client.set(key, _damaged(value, k))
    assert _ask_counting(consumer, "corrupted", baseline) == 0
    assert wait_until(lambda: client.dbsize() < len(good), timeout_s=10)  # the reader removed what it proved damaged
    for key, value in good.items():
        client.set(key, value)
    _loads_again(consumer, "corrupted", baseline)


def test_consumer_stayed_clean(consumer):
    assert consumer.healthy()
    assert log_problems(consumer) == []
    metrics = settled(consumer)
    assert metrics.total("vllm:tiercache_stored_blocks_total") == 0
    assert metrics.total("vllm:tiercache_failed_loads_total") == 0
