"""The host cache server with engines attached: real sockets, a real shared region, real Redis.

Each test plays engines: it copies bytes into the slots ``begin_writes`` gives
and reads those a fetch pins, through the region its client mapped.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import redis
from support.host_helpers import (
    WAIT_S,
    cached_blocks,
    client,
    held_slots,
    host_config,
    write,
)
from support.lower_tiers_helpers import block_bytes, chain, until
from support.lower_tiers_helpers import write as lower_write

from tiercache.host import wire
from tiercache.host.client import HostAttachError, HostTiers
from tiercache.host.server import HostServer
from tiercache.manager.lower_tiers import LowerTiers
from tiercache.testing.redis_servers import RedisServer


def serve(socket_dir: Path, servers: list[HostServer], **kwargs: object) -> HostServer:
    config = kwargs.pop("config", None) or host_config(**kwargs.pop("topology", {}))  # type: ignore[arg-type]
    server = HostServer(config, socket_dir / "host.sock", shared_dir=socket_dir, **kwargs)  # type: ignore[arg-type]
    servers.append(server)
    return server.start()


def read(tiers: HostTiers, slots: list[int]) -> list[bytes]:
    return [bytes(tiers.buffer_view(slot)) for slot in slots]


def test_an_engine_reads_from_the_host_tier_what_another_engine_stored(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers)
    first, second = client(server.socket_path, opened), client(server.socket_path, opened)
    keys = chain(first, 4, salt=1)
    write(first, keys)
    hit = second.lookup(keys)
    assert hit is not None and hit.tiers == ["cpu"] * 4
    fetch = second.fetch(hit)
    assert fetch.ready()
    assert read(second, fetch.slots()) == [block_bytes(first, key) for key in keys]
    assert held_slots(server) == 4, "pinned for the second engine until it releases them"
    fetch.release()
    until(lambda: held_slots(server) == 0)


def test_a_prefix_two_engines_store_is_held_once(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers)
    first, second = client(server.socket_path, opened), client(server.socket_path, opened)
    keys = chain(first, 3, salt=2)
    write(first, keys)
    until(lambda: cached_blocks(server) == 3)
    assert second.begin_writes(keys) == [None, None, None], "held already: nothing to copy again"
    assert cached_blocks(server) == 3


def test_capacity_holds_across_engines(socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers, topology={"cpu_blocks": 4})
    engines = [client(server.socket_path, opened) for _ in range(3)]
    for salt, engine in enumerate(engines):
        write(engine, chain(engine, 3, salt=10 + salt))
    until(lambda: held_slots(server) == 0)
    assert cached_blocks(server) == 4
    hits = [engine.lookup(chain(engine, 3, salt=10 + salt)) for salt, engine in enumerate(engines)]
    assert sum(hit.num_blocks for hit in hits if hit is not None) <= 4, "no engine's hit is beyond the capacity"
    for engine, hit in zip(engines, hits, strict=True):
        assert hit is not None
        engine.release(hit)


def test_an_engine_that_goes_away_leaves_nothing_pinned(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers, lease_grace_s=0.0)
    first, second = client(server.socket_path, opened), client(server.socket_path, opened)
    keys = chain(first, 4, salt=3)
    write(first, keys)
    looked = second.lookup(keys[:2])
    fetched = second.fetch(second.lookup(keys) or looked)  # type: ignore[arg-type]
    assert fetched.ready() and len(fetched.slots()) == 4
    writing = second.begin_writes(chain(second, 2, salt=4))
    assert all(slot is not None for slot in writing)
    assert held_slots(server) > 0
    second.close()
    until(lambda: held_slots(server) == 0)
    assert first.lookup(chain(first, 2, salt=4)).num_blocks == 0, "the writes it never ended were not committed"


def test_an_engine_can_end_only_the_writes_it_was_given(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers)
    first, second = client(server.socket_path, opened), client(server.socket_path, opened)
    keys = chain(first, 2, salt=5)
    slots = [slot for slot in first.begin_writes(keys) if slot is not None]
    assert len(slots) == 2
    second.end_writes(keys, slots, [True, True])  # the first engine's slots, ended by another
    waiting = second.fetch(second.lookup(keys))  # type: ignore[arg-type]
    assert not waiting.ready(), "the writes in flight are still the first engine's: the fetch waits for them"
    for key, slot in zip(keys, slots, strict=True):
        first.buffer_view(slot)[:] = block_bytes(first, key)
    first.end_writes(keys, slots, [True, True])
    assert waiting.wait(WAIT_S)
    assert read(second, waiting.slots()) == [block_bytes(first, key) for key in keys]
    waiting.release()
    until(lambda: held_slots(server) == 0)


def test_a_lookup_waiting_for_a_remote_is_asked_again_across_the_socket(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers], redis_server: RedisServer,
        redis_client: redis.Redis) -> None:
    redis = {"type": "redis", "name": "redis", "options": {"url": redis_server.url}}
    topology = {"cpu_blocks": 8, "remotes": [redis]}
    elsewhere = LowerTiers(host_config(**topology))  # an engine on another host stores the prompt in Redis
    elsewhere.start()
    keys = chain(elsewhere, 3, salt=6)
    lower_write(elsewhere, keys)
    until(lambda: redis_client.dbsize() >= 3)
    elsewhere.close()
    server = serve(socket_dir, servers, topology=topology)
    other = client(server.socket_path, opened)
    assert other.lookup(keys, asker="request-1") is None, "the remote's answer is in flight"
    other.wait_for_answers(WAIT_S)
    hit = until(lambda: other.lookup(keys, asker="request-1"))
    assert hit.tiers == ["redis"] * 3
    fetch = other.fetch(hit)
    assert fetch.wait(WAIT_S)
    assert read(other, fetch.slots()) == [block_bytes(elsewhere, key) for key in keys]
    fetch.release()
    other.forget("request-1")
    until(lambda: held_slots(server) == 0)


def test_no_server_is_a_miss_and_the_engine_attaches_once_one_starts(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    engine = client(socket_dir / "host.sock", opened, retry_s=0.05)
    keys = chain(engine, 2, salt=7)
    assert not engine.attached
    assert engine.lookup(keys).num_blocks == 0
    assert engine.begin_writes(keys) == [None, None]
    assert engine.fetch(engine.lookup(keys)).ready()
    assert engine.stats() == {"host": {"attached": False}}
    serve(socket_dir, servers)
    assert engine.wait_attached(WAIT_S)
    write(engine, keys)
    assert until(lambda: engine.lookup(keys).num_blocks == 2)


def test_a_server_restarted_is_a_miss_meanwhile_then_serves_from_its_remote(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers], redis_server: RedisServer,
        redis_client: redis.Redis) -> None:
    redis = {"type": "redis", "name": "redis", "options": {"url": redis_server.url}}
    topology = {"cpu_blocks": 8, "remotes": [redis]}
    server = serve(socket_dir, servers, topology=topology)
    engine = client(server.socket_path, opened, retry_s=0.05, config=host_config(**topology))
    keys = chain(engine, 3, salt=8)
    write(engine, keys)
    until(lambda: redis_client.dbsize() >= 3)
    first_region = server.region.path if server.region else None
    server.close()
    assert engine.lookup(keys).num_blocks == 0, "a miss, never an exception"
    assert not engine.attached, "its first call found the server gone"
    assert first_region is not None and not first_region.exists(), "the region's file went with its server"
    restarted = serve(socket_dir, servers, topology=topology)
    assert engine.wait_attached(WAIT_S)
    hit = until(lambda: engine.lookup(keys))
    assert hit.tiers == ["redis"] * 3
    fetch = engine.fetch(hit)
    assert fetch.wait(WAIT_S)
    assert read(engine, fetch.slots()) == [block_bytes(engine, key) for key in keys], "through the new region"
    fetch.release()
    until(lambda: held_slots(restarted) == 0)


def test_a_damaged_or_truncated_region_is_refused(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers)
    assert server.region is not None
    path = server.region.path
    with open(path, "r+b") as region:
        region.write(b"NOTAHOST")
    damaged = client(server.socket_path, opened, retry_s=60)
    assert not damaged.attached and damaged.lookup([b"k" * 16]).num_blocks == 0
    os.truncate(path, 4096)
    truncated = client(server.socket_path, opened, retry_s=60)
    assert not truncated.attached


def test_an_engine_of_another_model_is_refused_at_start(socket_dir: Path, servers: list[HostServer]) -> None:
    server = serve(socket_dir, servers)
    engine = HostTiers(host_config(model="another-model"), server.socket_path)
    with pytest.raises(HostAttachError, match="another model"):
        engine.start()
    engine.close()


def test_the_socket_and_the_region_are_the_owner_and_group_s_only(
        socket_dir: Path, servers: list[HostServer]) -> None:
    server = serve(socket_dir, servers)
    assert server.region is not None
    for path in (server.socket_path, server.region.path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path


def test_garbage_on_the_socket_ends_that_connection_only(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers)
    engine = client(server.socket_path, opened)
    keys = chain(engine, 2, salt=9)
    for garbage in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x03abc", b"\x00\x00\x00\x01\xc1"):
        rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rogue.connect(str(server.socket_path))
        rogue.sendall(garbage)
        rogue.settimeout(WAIT_S)
        assert rogue.recv(1) == b"", "the server closed it"
        rogue.close()
    write(engine, keys)
    assert until(lambda: engine.lookup(keys).num_blocks == 2)
    assert wire.MAX_FRAME_BYTES < 0xFFFFFFFF


def test_misses_leave_no_lease_behind(socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = serve(socket_dir, servers)
    engine = client(server.socket_path, opened)
    for salt in range(50):  # requests whose prompts nothing holds, never fetched or released (a scheduler may not)
        assert engine.lookup(chain(engine, 2, salt=100 + salt)).num_blocks == 0
    assert engine.fetch(engine.lookup(chain(engine, 2, salt=99))).ready()
    (leases,) = server.stats()["host"]["leases"].values()
    assert leases == {"hits": 0, "fetches": 0, "writes": 0, "askers": 0}
