"""Shared fixtures: real Redis servers (single, several, a 3-node cluster).

``redis_server`` yields one started ``RedisServer`` (host, port, url, ``kill()``,
``stop()``/``cont()``, ``restart()``, ``cli()``); ``redis_factory(**kwargs)``
starts as many as a test needs (e.g. central + two regions); ``redis_client`` is a
redis-py client of ``redis_server``; ``namespace_secrets`` sets two fleets' secrets
in the environment; ``redis_cluster``
yields a started ``RedisClusterNodes``; ``sites`` a central and two regions
(``sync_sites.Topology``). All of them are torn down even when the
test fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis

pytest.register_assert_rewrite("tiercache.testing")  # the conformance checks' asserts say what failed

from support.sync_sites import Topology  # noqa: E402

from tiercache.testing.redis_servers import RedisClusterNodes, RedisServer  # noqa: E402 - after the rewrite hook, like any import


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """Call it to start a server: ``redis_factory(maxmemory="64mb", extra_args=[...])``."""
    servers: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis"), **kwargs)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    """One empty server (maxmemory 512mb, allkeys-lru), killed after the test."""
    return redis_factory()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A redis-py client of ``redis_server``, to see what the server holds and counts."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    yield client
    client.close()


@pytest.fixture
def namespace_secrets(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Two fleets' namespace secrets, set in the environment: ``model.secret_env`` names one of them."""
    secrets = {"TC_SECRET_A": "fleet A's namespace secret, 32 b", "TC_SECRET_B": "fleet B's namespace secret, 32 b"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    return secrets


@pytest.fixture
async def sites(redis_factory: Callable[..., RedisServer]) -> AsyncIterator[Topology]:
    """Central plus regions A and B (``sync_sites.Topology``); the tiers it made are closed after the test."""
    topo = Topology(redis_factory)
    try:
        yield topo
    finally:
        for tier in topo.tiers:
            await tier.close()


@pytest.fixture
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-master Redis Cluster (full coverage not required, so one node can go down)."""
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test (bitwise claims are made there; steadier on a shared machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def refused_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a port that refuses connections (a server started there, then killed)."""
    server = RedisServer(tmp_path_factory.mktemp("gone"))
    server.start()
    server.kill()
    return server.url
