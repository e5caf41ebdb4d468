"""``RegionalTier``: a versioned remote tier over a regional Redis and a central one.

Modes: ``central`` reads and writes the central store directly; ``regional``
reads and writes the region, replicates writes to central in the background
(``replicator.Replicator``) and reads a regional miss through from central,
back-filling the region.

``force_latest`` reads check central's version of every key of the batch first
(one round trip) and serve the regional copy only where it is at least that
version, or where it is this node's own acknowledged write still waiting for
replication (once replicated it gets a version above everything committed
before, so it is the latest this node can know). Anything else is read from
central and refreshed into the region. When central cannot be asked (down,
timed out, its breaker open), a force_latest read is a miss, this node's own
unreplicated writes included: a regional copy is never presented as latest
without central's word.

Decisions where docs/architecture.md, "Central and regional sync" is silent: a
regional put is acknowledged when the region stored it or, with the region
down, when it was queued for central; a full replication queue drops the
replication (counted), leaving an unversioned regional copy that force_latest
reads of other nodes bypass; ``delete`` removes the regional copy (and, in
``central`` mode, the central one) without a tombstone version.

Data path: reads, writes, EXISTS and deletes run on the Redis tier's nodes
(``plane``: its connections, TLS/AUTH, capacity check and breaker); plain reads
take its GET fast path straight into the destinations, and force_latest reads
keep each regional hit's version and checksum from its header. The control
plane (Lua commits, refreshes and stamps, pub/sub, CONFIG) stays on redis-py.

Failures: garbage (a value shorter than a header, a corrupt value, a version key
that is not a number) is a miss for its own key only, counted
(``invalid_values``, ``invalid_versions``), and a value proved damaged is deleted
from the store it was read from in the background (the ``RemoteTier`` base's
``invalid_values``; here only while it is still the value that was read);
failures of central and region are counted by cause (``diagnosis``: NOAUTH,
WRONGPASS, NOPERM, OOM, unreachable) and the latest is ``last_error``; a full
central that refuses commits gets room made by removing its oldest values
(``room``); ``close`` is bounded (``tiers/shutdown.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import ClassVar

from tiercache.blocks.value_format import Decoded, DecodeStatus
from tiercache.common.units import MS_PER_SECOND
from tiercache.tiers.base import Capabilities, Presence, RemoteContext, RemoteTier, ServerReachability, known_checksums
from tiercache.tiers.redis.control import connect
from tiercache.tiers.regional.client import GuardedClient
from tiercache.tiers.regional.diagnosis import Diagnosis
from tiercache.tiers.regional.invalidation import Invalidator
from tiercache.tiers.regional.options import RegionalOptions, SyncMode
from tiercache.tiers.regional.own_writes import OwnWrites
from tiercache.tiers.regional.plane import Plane, Read
from tiercache.tiers.regional.reachability import check_central, check_region
from tiercache.tiers.regional.replicator import ReplicationItem, Replicator
from tiercache.tiers.regional.retention import Retention, check_retention
from tiercache.tiers.regional.stores import CentralStore, Damaged, RegionStore, discard_damaged
from tiercache.tiers.regional.versions import value_checksum
from tiercache.tiers.shutdown import stop_tasks


class RegionalTier(RemoteTier):
    """Regional or central Redis with central versions, replication, read-through and force_latest."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        shared=True, versioned=True, persistent=False, takes_checksums=True
    )
    Options: ClassVar[type] = RegionalOptions

    def __init__(self, context: RemoteContext, options: RegionalOptions) -> None:
        super().__init__(context, options)
        if options.compress:
            self.codec = context.codec.variant(compress=True)
        self.mode = options.mode
        self.central: CentralStore | None = None
        self.region: RegionStore | None = None
        self.replicator: Replicator | None = None
        self.invalidator: Invalidator | None = None
        self.retention = Retention.UNKNOWN
        """What central does when full, as read at start (``retention.check_retention``)."""
        self._own = OwnWrites()
        """This node's acknowledged writes awaiting a central version."""
        self.counters: dict[str, float] = {
            "hits": 0,
            "misses": 0,
            "regional_hits": 0,
            "central_reads": 0,
            "read_through": 0,
            "refreshed": 0,
            "latest_unavailable": 0,
            "invalid_values": 0,
            "invalid_versions": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "write_failures": 0,
            "close_abandoned": 0,
        }

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Connect lazily; check central's retention and (once) that both servers accept us, logging causes."""
        options = self.options
        ttl_ms = round(options.central_ttl_s * MS_PER_SECOND)
        server, plane = self._server(options.central_url, "central")
        central = CentralStore(server, plane, options.key_prefix, options.channel, ttl_ms)
        self.central = central
        self.retention = await check_retention(central, options.central_ttl_s, self.name)
        if self.mode is SyncMode.CENTRAL:
            return
        self.region = RegionStore(*self._server(options.region_url, "region"), options.key_prefix)
        await self.region.plane.ping()
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
            self.invalidator = Invalidator(
                lambda: connect(central.plane.options),
                options.channel,
                self.region,
                lambda error: central.server.diagnosis.record(error, "subscribe"),
            )

    def _server(self, url: str, role: str) -> tuple[GuardedClient, Plane]:
        """The control-plane client and the data path of one server, sharing its breaker."""
        options = self.options.redis_options(url)
        diagnosis = Diagnosis(self.name, role, url, on_record=self.note_error)
        plane = Plane(f"{self.name}-{role}", options, self.codec, self.block_bytes, diagnosis)
        return GuardedClient(connect(options), plane.breaker, diagnosis), plane

    async def close(self) -> None:
        """Flush, stop and disconnect, bounded whatever a remote does.

        Queued replications get ``close_flush_ms``; the background tasks then
        ``close_timeout_ms`` to stop, and the connections ``close_timeout_ms`` to
        close. What does not stop in time is abandoned (logged, counted as
        ``close_abandoned``), so this returns within ``close_flush_ms + 2 x
        close_timeout_ms``.
        """
        options = self.options
        timeout_s = options.close_timeout_ms / MS_PER_SECOND
        loop = asyncio.get_running_loop()
        abandoned = 0
        if self.replicator is not None:
            flush = loop.create_task(self.replicator.flush(), name="tiercache-close-flush")
            flush_s = options.close_flush_ms / MS_PER_SECOND
            await stop_tasks([flush], grace_s=flush_s, cancel_s=timeout_s, what=self.name)
        parts = (self.replicator, self.invalidator, self.invalid_values)
        stopping = [part.close(timeout_s) for part in parts if part is not None]
        abandoned += sum(await asyncio.gather(*stopping))
        clients = [
            loop.create_task(closing, name=f"tiercache-close-{kind}")
            for kind, store in (("central", self.central), ("region", self.region))
            if store is not None
            for closing in (store.server.aclose(), store.plane.close())
        ]
        half_s = timeout_s / 2
        abandoned += await stop_tasks(clients, grace_s=half_s, cancel_s=half_s, what=self.name)
        self.counters["close_abandoned"] += abandoned

    async def check_reachability(self, key: bytes) -> list[ServerReachability]:
        """Central and (in regional mode) the region, each checked on its own (``reachability``)."""
        assert self.central is not None
        value = self.codec.encode_value(key, bytes(self.block_bytes))
        servers = [await check_central(self.central, key, value)]
        if self.region is not None:
            servers.append(await check_region(self.region, key, value))
        return servers

    async def flush(self) -> None:
        """Wait until this node's queued replications have been committed or given up."""
        if self.replicator is not None:
            await self.replicator.flush()

    def _replicated(self, item: ReplicationItem, version: int | None) -> None:
        self._own.replicated(item.key, item.checksum)

    # ---- reads -----------------------------------------------------------------------
    def _decode(
        self, key: bytes, value: bytes | None, dest: memoryview, invalid: list[tuple[Damaged, DecodeStatus]]
    ) -> Decoded | None:
        """Validate central's ``value`` into ``dest``; a value that fails is counted and added to ``invalid``."""
        if value is None:
            return None
        decoded = self.codec.decode_into(key, value, dest)
        if not decoded.ok:
            self.counters["invalid_values"] += 1
            invalid.append(((self.central, key, value), decoded.status))
            return None
        return decoded

    def _damaged(self, key: bytes, value: bytes) -> bool:
        """Whether ``value`` (read again for deletion) is still provably damaged."""
        return self.codec.decode_into(key, value, memoryview(bytearray(self.block_bytes))).status.damaged

    def _discard_invalid(self, store: CentralStore | RegionStore, keys: Sequence[bytes], read: Read) -> None:
        """Count the values ``read`` found invalid; report them (the damaged are deleted from ``store``)."""
        if read.invalid:
            self.counters["invalid_values"] += len(read.invalid)
            self.invalid_values.report(((store, keys[i], None), status) for i, status in read.invalid)

    async def delete_damaged(self, items: list[Damaged]) -> int:
        """Delete damaged values from the store they were read from, unless rewritten since (``discard_damaged``)."""
        return await discard_damaged(items, self._damaged)

    def _count(self, results: list[bool]) -> list[bool]:
        hits = sum(results)
        self.counters["hits"] += hits
        self.counters["misses"] += len(results) - hits
        self.counters["bytes_read"] += hits * self.block_bytes
        return results

    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        """Held where either store holds it; absent only where every store asked answered so."""
        assert self.central is not None
        if self.region is None:
            return await self.central.exists(keys)
        regional = await self.region.exists(keys)
        missing = [i for i, found in enumerate(regional) if found is not Presence.HELD]
        if missing:
            central = await self.central.exists([keys[i] for i in missing])
            for i, found in zip(missing, central, strict=True):
                if found is Presence.HELD or regional[i] is Presence.ABSENT:
                    regional[i] = found
        return regional

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        assert self.central is not None
        if self.region is None:
            read = await self.central.get_into(keys, dests)
            self.counters["central_reads"] += len(keys)
            self._discard_invalid(self.central, keys, read)
            return self._count(read.results)
        if force_latest:
            return await self._get_latest(keys, dests)
        read = await self.region.get_into(keys, dests)
        self._discard_invalid(self.region, keys, read)
        results = read.results
        missing = [i for i, hit in enumerate(results) if not hit]
        self.counters["regional_hits"] += len(keys) - len(missing)
        if missing:
            await self._from_central(keys, dests, missing, [0] * len(missing), results)
            self.counters["read_through"] += sum(results[i] for i in missing)
        return self._count(results)

    async def _get_latest(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]:
        assert self.central is not None and self.region is not None
        versions = await self.central.versions(keys)
        if versions is None:
            self.counters["latest_unavailable"] += len(keys)
            self.counters["misses"] += len(keys)
            return [False] * len(keys)
        read = await self.region.get_into(keys, dests, versioned=True)
        self._discard_invalid(self.region, keys, read)
        results = [False] * len(keys)
        from_central, floors = [], []
        for i, (key, version) in enumerate(zip(keys, versions, strict=True)):
            if version is None:
                self.counters["invalid_versions"] += 1
            elif read.results[i] and self._serves_as_latest(key, read.versions[i], read.checksums[i], version):
                results[i] = True
                self.counters["regional_hits"] += 1
            elif key not in self._own and version > 0:
                from_central.append(i)
                floors.append(version)
        if from_central:
            await self._from_central(keys, dests, from_central, floors, results)
        return self._count(results)

    def _serves_as_latest(self, key: bytes, held: int, checksum: bytes, version: int) -> bool:
        """Whether a valid regional copy (``held``: its version) is central's ``version`` or newer, or
        this node's own unreplicated write (same checksum)."""
        return self._own.is_own(key, checksum) or (version > 0 and held >= version)

    async def _from_central(
        self,
        keys: Sequence[bytes],
        dests: Sequence[memoryview],
        indices: list[int],
        floors: list[int],
        results: list[bool],
    ) -> None:
        """Read ``indices`` from central (at least version ``floors``) and refresh the region."""
        assert self.central is not None and self.region is not None
        fetched = await self.central.read([keys[i] for i in indices]) or [None] * len(indices)
        self.counters["central_reads"] += len(indices)
        refresh = []
        invalid: list[tuple[Damaged, DecodeStatus]] = []
        for i, floor, value in zip(indices, floors, fetched, strict=True):
            decoded = self._decode(keys[i], value, dests[i], invalid)
            if decoded is None or decoded.version < floor:
                continue
            assert value is not None
            results[i] = True
            refresh.append((keys[i], value, decoded.version))
        self.invalid_values.report(invalid)
        if refresh:
            self.counters["refreshed"] += sum(await self.region.refresh(refresh))

    # ---- writes ----------------------------------------------------------------------
    async def put(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        assert self.central is not None
        values = [
            self.codec.encode_value(key, payload, checksum=checksum)
            for key, payload, checksum in zip(keys, payloads, known_checksums(checksums, len(keys)), strict=True)
        ]
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
                self._own.offered(key, checksum, queued)
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

    def tier_stats(self) -> dict[str, float]:
        stats = {**self.counters, "own_unreplicated": len(self._own)}
        if self.central is not None:
            stats.update(self.central.server.stats("central"))
            stats.update(self.central.plane.stats("central"))
            stats["central_commit_failed"] = self.central.commit_failed
            stats.update(self.central.room.stats("central"))
            stats["central_retention_stops"] = float(self.retention is Retention.STOPS)
        if self.region is not None:
            stats.update(self.region.server.stats("region"))
            stats.update(self.region.plane.stats("region"))
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
