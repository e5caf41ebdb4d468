"""Every remote tier runs the remote-tier contract's conformance suite (``tiercache.testing.conformance``).

Simulated, Redis, Redis Cluster, regional (central only, and region + central),
file, and a tier defined in a test module (``plugin_tier``) that a topology loads
by module path: each gets a ``StoreHarness`` here (open a tier over a shared
store, open one over an unreachable store, raw bytes of the store) and the
suite's checks become its tests. Real servers and real files throughout.
"""

from __future__ import annotations

import asyncio
import binascii
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster
import yaml
from support import plugin_tier
from support.file_tier_helpers import segments_in

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.config import load_config
from tiercache.testing.conformance import RemoteTierContract
from tiercache.testing.harness import StoreHarness
from tiercache.testing.redis_servers import RedisClusterNodes, RedisServer
from tiercache.tiers import tier_class
from tiercache.tiers.base import RemoteContext, RemoteTier
from tiercache.tiers.file import FileOptions, FileTier
from tiercache.tiers.file.records import ALIGNED, RecordKind, scan
from tiercache.tiers.redis import RedisOptions, RedisTier
from tiercache.tiers.regional import RegionalOptions, RegionalTier, SyncMode
from tiercache.tiers.simulated import SimulatedOptions, SimulatedTier
from tiercache.tiers.simulated.store import SimulatedStore

FAST = {"timeout_s": 0.5, "connect_timeout_s": 0.5, "breaker_backoff_s": 0.2, "breaker_backoff_max_s": 0.4}
"""Short socket timeouts, so an unreachable store answers quickly."""
REGIONAL_PREFIX = "tc:"
_names = itertools.count()


# ---- simulated ----------------------------------------------------------------------------
class SimulatedHarness(StoreHarness):
    """Tiers over one named simulated store; unreachable: down from the start."""

    def __init__(self) -> None:
        self.store = f"conformance-{next(_names)}"

    async def _start(self, codec: Codec, **options: object) -> RemoteTier:
        tier = SimulatedTier(RemoteContext("sim", codec, self.block_bytes), SimulatedOptions(latency_ms=0, **options))
        await tier.start()
        return tier

    async def open(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, store=self.store)

    async def open_unreachable(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, store=f"{self.store}-down", down_windows_s=[[0.0, 3600.0]])

    async def read_raw(self, key: bytes) -> bytes | None:
        return SimulatedStore.named(self.store, SimulatedOptions()).data.get(key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        SimulatedStore.named(self.store, SimulatedOptions()).save(key, value)

    def forget(self) -> None:
        SimulatedStore.forget(self.store)
        SimulatedStore.forget(f"{self.store}-down")


class TestSimulatedTier(RemoteTierContract):
    @pytest.fixture
    def harness(self) -> Iterator[SimulatedHarness]:
        harness = SimulatedHarness()
        yield harness
        harness.forget()


# ---- Redis and Redis Cluster --------------------------------------------------------------
class RedisHarness(StoreHarness):
    """Tiers on one Redis server (or cluster); raw access through redis-py."""

    def __init__(self, url: str, refused_url: str, client: redis.Redis, **options: object) -> None:
        self.url, self.refused_url, self.client, self.options = url, refused_url, client, {**FAST, **options}

    async def _start(self, codec: Codec, url: str) -> RemoteTier:
        tier = RedisTier(RemoteContext("redis", codec, self.block_bytes), RedisOptions(url=url, **self.options))
        await tier.start()
        return tier

    async def open(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, self.url)

    async def open_unreachable(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, self.refused_url)

    @staticmethod
    def name(key: bytes) -> bytes:
        return b"tiercache:" + binascii.hexlify(key)

    async def read_raw(self, key: bytes) -> bytes | None:
        return await asyncio.to_thread(self.client.get, self.name(key))

    async def write_raw(self, key: bytes, value: bytes) -> None:
        await asyncio.to_thread(self.client.set, self.name(key), value)


class TestRedisTier(RemoteTierContract):
    @pytest.fixture
    def harness(self, redis_server: RedisServer, refused_url: str) -> Iterator[RedisHarness]:
        client = redis.Redis(host=redis_server.host, port=redis_server.port)
        yield RedisHarness(redis_server.url, refused_url, client)
        client.close()


class TestRedisTierStagingReads(RemoteTierContract):
    """``stage_reads: true`` takes the other read path (whole value validated before any copy)."""

    @pytest.fixture
    def harness(self, redis_server: RedisServer, refused_url: str) -> Iterator[RedisHarness]:
        client = redis.Redis(host=redis_server.host, port=redis_server.port)
        yield RedisHarness(redis_server.url, refused_url, client, stage_reads=True)
        client.close()


class TestRedisClusterTier(RemoteTierContract):
    @pytest.fixture
    def harness(self, redis_cluster: RedisClusterNodes, refused_url: str) -> Iterator[RedisHarness]:
        client = redis.cluster.RedisCluster(host=redis_cluster.host, port=redis_cluster.port)
        yield RedisHarness(redis_cluster.url, refused_url, client, cluster=True)
        client.close()


# ---- regional -----------------------------------------------------------------------------
class RegionalHarness(StoreHarness):
    """Regional tiers over central (and a region); raw writes go to every store, raw reads to the first read."""

    def __init__(self, central: RedisServer, region: RedisServer | None, refused_url: str) -> None:
        self.central, self.region, self.refused_url = central, region, refused_url
        self.servers = [server for server in (region, central) if server is not None]
        self.clients = [redis.Redis(host=server.host, port=server.port) for server in self.servers]
        self.copies = len(self.servers)
        self.queues_writes = region is not None  # a put with the region down is queued for central

    def _options(self, central_url: str, region_url: str) -> RegionalOptions:
        mode = SyncMode.REGIONAL if self.region is not None else SyncMode.CENTRAL
        return RegionalOptions(
            central_url=central_url, region_url=region_url, mode=mode, invalidate=False, **FAST
        )

    async def _start(self, codec: Codec, options: RegionalOptions) -> RemoteTier:
        tier = RegionalTier(RemoteContext("regional", codec, self.block_bytes), options)
        await tier.start()
        return tier

    async def open(self, codec: Codec) -> RemoteTier:
        region_url = self.region.url if self.region is not None else ""
        return await self._start(codec, self._options(self.central.url, region_url))

    async def open_unreachable(self, codec: Codec) -> RemoteTier:
        region_url = self.refused_url if self.region is not None else ""
        return await self._start(codec, self._options(self.refused_url, region_url))

    @staticmethod
    def name(key: bytes) -> str:
        return f"{REGIONAL_PREFIX}{{{key.hex()}}}:v"

    async def read_raw(self, key: bytes) -> bytes | None:
        return await asyncio.to_thread(self.clients[0].get, self.name(key))

    async def write_raw(self, key: bytes, value: bytes) -> None:
        for client in self.clients:
            await asyncio.to_thread(client.set, self.name(key), value)

    async def settle(self, tier: RemoteTier) -> None:
        assert isinstance(tier, RegionalTier)
        await tier.flush()
        await tier.settle()

    def close(self) -> None:
        for client in self.clients:
            client.close()


class TestRegionalTierCentralMode(RemoteTierContract):
    @pytest.fixture
    def harness(self, redis_factory, refused_url: str) -> Iterator[RegionalHarness]:
        harness = RegionalHarness(redis_factory(), None, refused_url)
        yield harness
        harness.close()


class TestRegionalTierRegionalMode(RemoteTierContract):
    @pytest.fixture
    def harness(self, redis_factory, refused_url: str) -> Iterator[RegionalHarness]:
        harness = RegionalHarness(redis_factory(), redis_factory(), refused_url)
        yield harness
        harness.close()


# ---- file ---------------------------------------------------------------------------------
class FileHarness(StoreHarness):
    """File tiers over one directory; raw access by scanning and appending segment records."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.raw_segments = itertools.count(1)

    async def _start(self, codec: Codec, path: Path) -> RemoteTier:
        options = FileOptions(path=str(path), max_blocks=4096, gc_interval_s=3600.0)
        tier = FileTier(RemoteContext("file", codec, self.block_bytes), options)
        await tier.start()
        return tier

    async def open(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, self.root)

    async def open_unreachable(self, codec: Codec) -> RemoteTier:
        blocker = self.root.parent / f"{self.root.name}-not-a-directory"
        blocker.write_text("a file where the tier's directory would be")
        return await self._start(codec, blocker / "tier")

    def _newest(self, key: bytes) -> bytes | None:
        """The newest value record of ``key`` not hidden by a tombstone (read from the segments themselves)."""
        value_version, body, tombstone = -1, None, -1
        for segment in segments_in(self.root):
            fd = os.open(segment.path, os.O_RDONLY)
            try:
                records, _ = scan(fd, 0, segment.size, HEADER_SIZE + self.block_bytes)
                for record in records:
                    if record.key != key:
                        continue
                    if record.kind is RecordKind.TOMBSTONE:
                        tombstone = max(tombstone, record.version)
                    elif record.version > value_version:
                        value_version, body = record.version, os.pread(fd, record.length, record.offset)
            finally:
                os.close(fd)
        return body if value_version > tombstone else None

    async def read_raw(self, key: bytes) -> bytes | None:
        return await asyncio.to_thread(self._newest, key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        record = ALIGNED.record(RecordKind.VALUE, key, time.time_ns(), value)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"raw-writer-{os.getpid()}.{next(self.raw_segments):06d}.seg"
        path.write_bytes(record)
        assert len(record) == ALIGNED.span(len(value))


class TestFileTier(RemoteTierContract):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> FileHarness:
        return FileHarness(tmp_path / "tier")


# ---- a tier outside tiercache, loaded by module path ----------------------------------------
class PluginHarness(StoreHarness):
    """``support.plugin_tier:DictTier`` built from a YAML topology that names it by module path."""

    def __init__(self, topology: Path) -> None:
        config = load_config(topology, environ={})
        (self.tier_config,) = [tier for tier in config.tiers if tier.type == "support.plugin_tier:DictTier"]
        self.store = plugin_tier.STORES.setdefault(self.tier_config.options.store, {})

    async def _start(self, codec: Codec, options: plugin_tier.DictOptions) -> RemoteTier:
        cls = tier_class(self.tier_config.type)
        tier = cls(RemoteContext(self.tier_config.name, codec, self.block_bytes), options)
        await tier.start()
        return tier

    async def open(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, self.tier_config.options)

    async def open_unreachable(self, codec: Codec) -> RemoteTier:
        return await self._start(codec, plugin_tier.DictOptions(store=self.tier_config.options.store, down=True))

    async def read_raw(self, key: bytes) -> bytes | None:
        return self.store.get(key)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        self.store[key] = value


PLUGIN_TOPOLOGY = {
    "model": {"id": "plugin-test"},
    "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_size": 8},
    "tiers": [
        {"type": "gpu", "capacity_blocks": 16, "options": {"device": "cpu"}},
        {"type": "cpu", "capacity_blocks": 32},
        {"type": "support.plugin_tier:DictTier", "options": {"store": "conformance"}},
    ],
}


class TestPluginTierByModulePath(RemoteTierContract):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> Iterator[PluginHarness]:
        path = tmp_path / "topology.yaml"
        path.write_text(yaml.safe_dump(PLUGIN_TOPOLOGY))
        yield PluginHarness(path)
        plugin_tier.STORES.clear()

    def test_the_topology_named_it(self, harness: PluginHarness) -> None:
        assert harness.tier_config.name == "DictTier"
        assert isinstance(harness.tier_config.options, plugin_tier.DictOptions)
        assert tier_class(harness.tier_config.type) is plugin_tier.DictTier
