"""A versioned remote tier over a regional Redis and a central one (DESIGN.md, central/regional sync).

Modes: ``central`` reads and writes the central store directly; ``regional``
reads and writes the region, replicates writes to central in the background
(``tiercache.sync.Replicator``) and reads a regional miss through from central,
back-filling the region.

``force_latest`` reads check central's version of every key of the batch first
(one round trip) and serve the regional copy only where it is at least that
version, or where it is this node's own acknowledged write still waiting for
replication (once replicated it gets a version above everything committed
before, so it is the latest this node can know). Anything else is read from
central and refreshed into the region. When central cannot be asked, a
force_latest read is a miss: a regional copy is never presented as latest
without central's word.

Decisions where DESIGN.md is silent: a regional put is acknowledged when the
region stored it or, with the region down, when it was queued for central; a
full replication queue drops the replication (counted), leaving an unversioned
regional copy that force_latest reads of other nodes bypass; ``delete`` removes
the regional copy (and, in ``central`` mode, the central one) without a
tombstone version.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from tiercache.breaker import CircuitBreaker
from tiercache.codec import Codec, Decoded
from tiercache.sync import (
    CentralStore,
    GuardedClient,
    Invalidator,
    RegionStore,
    ReplicationItem,
    Replicator,
    SyncMode,
    connect,
    value_checksum,
    value_version,
)
from tiercache.tiers.base import Capabilities, RemoteContext, RemoteTier
from tiercache.validate import (
    MAX_RETRIES,
    int_in_range,
    positive_timeout_ms,
    positive_timeout_s,
    queue_size,
    redis_url,
    worker_count,
)

MS_PER_SECOND = 1000.0


@dataclass
class RegionalOptions:
    """The YAML ``options`` of a ``regional`` tier."""

    central_url: str
    region_url: str = ""
    """Required in ``regional`` mode."""
    mode: SyncMode = SyncMode.REGIONAL
    key_prefix: str = "tc:"
    channel: str = "tiercache:updates"
    """Central's pub/sub channel of committed versions."""
    invalidate: bool = True
    """Subscribe to the channel and drop older regional copies early."""
    replication_queue_blocks: int = 4096
    replication_workers: int = 2
    replication_batch_blocks: int = 32
    replication_retries: int = 5
    retry_backoff_ms: float = 20.0
    """First retry pause; doubles per attempt."""
    socket_timeout_ms: float = 500.0
    breaker_failures: int = 3
    """Consecutive failures after which calls to that server fail at once (misses) for a back-off."""
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0
    close_flush_ms: float = 2000.0
    """How long ``close`` lets queued replications finish."""
    compress: bool = False

    def __post_init__(self) -> None:
        redis_url("central_url", self.central_url)
        if self.region_url:
            redis_url("region_url", self.region_url)
        worker_count("replication_workers", self.replication_workers)
        queue_size("replication_queue_blocks", self.replication_queue_blocks)
        queue_size("replication_batch_blocks", self.replication_batch_blocks)
        int_in_range("replication_retries", self.replication_retries, 0, MAX_RETRIES)
        int_in_range("breaker_failures", self.breaker_failures, 1, MAX_RETRIES)
        for name in ("retry_backoff_ms", "socket_timeout_ms", "close_flush_ms"):
            positive_timeout_ms(name, getattr(self, name))
        for name in ("breaker_backoff_s", "breaker_backoff_max_s"):
            positive_timeout_s(name, getattr(self, name))
        if self.mode is SyncMode.REGIONAL and not self.region_url:
            raise ValueError("region_url is required in regional mode")
        for name in ("replication_queue_blocks", "replication_workers", "replication_batch_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replication_retries < 0:
            raise ValueError(f"replication_retries must be >= 0, got {self.replication_retries}")
        if self.breaker_failures < 1 or not 0 < self.breaker_backoff_s <= self.breaker_backoff_max_s:
            raise ValueError("need breaker_failures >= 1 and 0 < breaker_backoff_s <= breaker_backoff_max_s")
        for name in ("retry_backoff_ms", "socket_timeout_ms", "close_flush_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class RegionalTier(RemoteTier):
    """Regional or central Redis with central versions, replication, read-through and force_latest."""

    capabilities: ClassVar[Capabilities] = Capabilities(shared=True, versioned=True, persistent=False)
    Options: ClassVar[type] = RegionalOptions

    def __init__(self, context: RemoteContext, options: RegionalOptions) -> None:
        super().__init__(context, options)
        if options.compress:
            self.codec = Codec(context.codec.fingerprint, compress=True)
        self.mode = options.mode
        self.central: CentralStore | None = None
        self.region: RegionStore | None = None
        self.replicator: Replicator | None = None
        self.invalidator: Invalidator | None = None
        self._own: dict[bytes, bytes] = {}
        """This node's acknowledged writes awaiting a central version: key -> checksum."""
        self.counters: dict[str, float] = {
            "hits": 0,
            "misses": 0,
            "regional_hits": 0,
            "central_reads": 0,
            "read_through": 0,
            "refreshed": 0,
            "latest_unavailable": 0,
            "invalid_values": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "write_failures": 0,
        }

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        options = self.options
        self.central = CentralStore(self._server(options.central_url), options.key_prefix, options.channel)
        if self.mode is SyncMode.CENTRAL:
            return
        self.region = RegionStore(self._server(options.region_url), options.key_prefix)
        self.replicator = Replicator(
            self.central,
            self.region,
            capacity=options.replication_queue_blocks,
            workers=options.replication_workers,
            batch=options.replication_batch_blocks,
            retries=options.replication_retries,
            backoff_s=options.retry_backoff_ms / MS_PER_SECOND,
            on_done=self._replicated,
        )
        if options.invalidate:
            self.invalidator = Invalidator(options.central_url, options.channel, self.region)

    def _server(self, url: str) -> GuardedClient:
        options = self.options
        breaker = CircuitBreaker(options.breaker_failures, options.breaker_backoff_s, options.breaker_backoff_max_s)
        return GuardedClient(connect(url, options.socket_timeout_ms / MS_PER_SECOND), breaker)

    async def close(self) -> None:
        if self.replicator is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.replicator.flush(), self.options.close_flush_ms / MS_PER_SECOND)
            await self.replicator.close()
        if self.invalidator is not None:
            await self.invalidator.close()
        for store in (self.central, self.region):
            if store is not None:
                await store.server.aclose()

    async def flush(self) -> None:
        """Wait until this node's queued replications have been committed or given up."""
        if self.replicator is not None:
            await self.replicator.flush()

    def pause_replication(self) -> None:
        """Hold replication (writes stay queued), e.g. for maintenance of central."""
        if self.replicator is not None:
            self.replicator.running.clear()

    def resume_replication(self) -> None:
        if self.replicator is not None:
            self.replicator.running.set()

    def _replicated(self, item: ReplicationItem, version: int | None) -> None:
        if self._own.get(item.key) == item.checksum:
            del self._own[item.key]

    # ---- reads -----------------------------------------------------------------------
    def _decode(self, key: bytes, value: bytes | None, dest: memoryview) -> Decoded | None:
        if value is None:
            return None
        decoded = self.codec.decode_into(key, value, dest)
        if not decoded.ok:
            self.counters["invalid_values"] += 1
            return None
        return decoded

    def _count(self, results: list[bool], values: Sequence[bytes | None]) -> list[bool]:
        hits = sum(results)
        self.counters["hits"] += hits
        self.counters["misses"] += len(results) - hits
        self.counters["bytes_read"] += sum(len(v) for v, ok in zip(values, results, strict=True) if ok and v)
        return results

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        assert self.central is not None
        if self.region is None:
            return await self.central.exists(keys) or [False] * len(keys)
        regional = await self.region.exists(keys) or [False] * len(keys)
        missing = [i for i, found in enumerate(regional) if not found]
        if missing:
            central = await self.central.exists([keys[i] for i in missing]) or [False] * len(missing)
            for i, found in zip(missing, central, strict=True):
                regional[i] = found
        return regional

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        assert self.central is not None
        if self.region is None:
            values = await self.central.read(keys) or [None] * len(keys)
            self.counters["central_reads"] += len(keys)
            results = [self._decode(k, v, d) is not None for k, v, d in zip(keys, values, dests, strict=True)]
            return self._count(results, values)
        if force_latest:
            return await self._get_latest(keys, dests)
        values = list(await self.region.read(keys) or [None] * len(keys))
        results = [False] * len(keys)
        missing = []
        for i, (key, value, dest) in enumerate(zip(keys, values, dests, strict=True)):
            if self._decode(key, value, dest) is not None:
                results[i] = True
                self.counters["regional_hits"] += 1
            else:
                missing.append(i)
        if missing:
            await self._from_central(keys, dests, missing, [0] * len(missing), values, results)
            self.counters["read_through"] += sum(results[i] for i in missing)
        return self._count(results, values)

    async def _get_latest(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]:
        assert self.central is not None and self.region is not None
        versions = await self.central.versions(keys)
        if versions is None:
            self.counters["latest_unavailable"] += len(keys)
            self.counters["misses"] += len(keys)
            return [False] * len(keys)
        values = list(await self.region.read(keys) or [None] * len(keys))
        results = [False] * len(keys)
        from_central, floors = [], []
        for i, (key, value, dest) in enumerate(zip(keys, values, dests, strict=True)):
            own = self._own.get(key)
            current = value is not None and (
                (own is not None and value_checksum(value) == own)
                or (versions[i] > 0 and value_version(value) >= versions[i])
            )
            if current and self._decode(key, value, dest) is not None:
                results[i] = True
                self.counters["regional_hits"] += 1
            elif own is None and versions[i] > 0:
                from_central.append(i)
                floors.append(versions[i])
        if from_central:
            await self._from_central(keys, dests, from_central, floors, values, results)
        return self._count(results, values)

    async def _from_central(
        self,
        keys: Sequence[bytes],
        dests: Sequence[memoryview],
        indices: list[int],
        floors: list[int],
        values: list[bytes | None],
        results: list[bool],
    ) -> None:
        """Read ``indices`` from central (at least version ``floors``) and refresh the region."""
        assert self.central is not None and self.region is not None
        fetched = await self.central.read([keys[i] for i in indices]) or [None] * len(indices)
        self.counters["central_reads"] += len(indices)
        refresh = []
        for i, floor, value in zip(indices, floors, fetched, strict=True):
            decoded = self._decode(keys[i], value, dests[i])
            if decoded is None or decoded.version < floor:
                continue
            assert value is not None
            results[i] = True
            values[i] = value
            refresh.append((keys[i], value, decoded.version))
        if refresh:
            self.counters["refreshed"] += sum(await self.region.refresh(refresh))

    # ---- writes ----------------------------------------------------------------------
    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        assert self.central is not None
        values = [self.codec.encode_value(key, payload) for key, payload in zip(keys, payloads, strict=True)]
        items = list(zip(keys, values, strict=True))
        if self.region is None:
            results = [version is not None for version in await self.central.commit(items)]
        else:
            assert self.replicator is not None
            stored = await self.region.write(items)
            now = time.monotonic()
            results = []
            for (key, value), ok in zip(items, stored, strict=True):
                checksum = value_checksum(value)
                queued = self.replicator.offer(ReplicationItem(key, value, checksum, now))
                if queued:
                    self._own[key] = checksum
                elif self._own.get(key) is not None:
                    del self._own[key]
                results.append(ok or queued)
        written = sum(len(v) for v, ok in zip(values, results, strict=True) if ok)
        self.counters["bytes_written"] += written
        self.counters["write_failures"] += len(results) - sum(results)
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        if self.region is not None:
            await self.region.delete(keys)
        elif self.central is not None:
            await self.central.delete(keys)

    def stats(self) -> dict[str, float]:
        stats = {**self.counters, "own_unreplicated": len(self._own)}
        if self.central is not None:
            stats.update(self.central.server.stats("central"))
        if self.region is not None:
            stats.update(self.region.server.stats("region"))
        if self.replicator is not None:
            stats.update(self.replicator.counters)
            stats["replication_queue"] = self.replicator.queue.qsize()
            replicated = self.replicator.counters["replicated"]
            stats["replication_lag_ms_mean"] = self.replicator.lag_ms_total / replicated if replicated else 0.0
            stats["replication_lag_ms_max"] = self.replicator.lag_ms_max
        if self.invalidator is not None:
            stats["updates_received"] = self.invalidator.received
            stats["invalidated"] = self.invalidator.dropped
        return stats
