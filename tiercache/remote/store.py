"""RemoteStore: a topology's remote tiers for an engine that keeps its own GPU and CPU tiers.

The hierarchy (docs/architecture.md, "Hierarchy") ends in remote stores (Redis,
Redis Cluster, regional + central, file, simulated) below the pinned-CPU swap
space. An engine with its own GPU pool and CPU tier (vLLM's offloading tiers,
SGLang's HiCache) needs only that lower part, addressed with its own keys and
its own buffers. A ``RemoteStore`` builds exactly the remote part of a topology, the same way the
``TierManager``'s stack does: each tier with its options (TLS/AUTH, breakers,
timeouts), the namespace's codec (with the keyed MAC when ``model.secret_env``
names a secret), one transfer-queue lane per tier (its limiter, breaker and
deadlines) and a background runtime. Nothing here touches GPU or CPU tiers.

- **Namespace and keys.** The caller names the namespace (``keys.Namespace``:
  model, a fingerprint of what fixes a block's bytes, parallel rank; the
  topology may add a tenant salt and LoRA id) and the bytes per block. ``key``
  maps an engine's own block key into a 16-byte tiercache key of that
  namespace (keyed BLAKE2b with the namespace root as key), so two engines of
  one model share entries and different models, dtypes, ranks or secrets
  (``model.secret_env``: ``tiercache.remote.secret``) never do, nor touch each other's
  values; the codec's fingerprint makes a value of another namespace a miss.
- **Presence** is non-blocking: ``contains`` a future of one ``PresenceAnswer``
  (``answers``) per key, the fastest tier that holds it, with the three-valued
  presence of docs/architecture.md, "The contract with the engine": ``HELD``,
  ``ABSENT`` (every tier answered and none holds it) or ``UNKNOWN`` (some tier
  could not tell: timeout, breaker open, garbage), which is neither a hit nor
  evidence of removal. ``presence`` answers the same from memory, by the engine's
  own keys, for a scheduler that asks every step (the presence cache,
  ``tiercache.movement.presence``): None while the tiers' answer is in flight.
- **Reads** (``read``) fill the caller's buffers (memoryviews of exactly the
  block bytes), trying the tiers fastest first; a block found in a slower tier
  is written back into the faster ones (from a copy, off the read's path).
  ``force_latest`` reads only versioned tiers (the regional tier checks
  central's version). **Writes** (``write``) go to every tier from the caller's
  buffers. Both return per-key booleans as a future; a failure of any kind is a
  ``False`` (a miss, a failed key), never an exception, and a read's future
  resolves only once no tier touches the buffers any more, so the caller may
  reuse them then: a read past its lane's deadline fails its keys, tries no
  slower tier, and resolves when the late call has run out. The caller keeps its
  buffers alive until then.
- **Back-pressure.** Writes in flight are bounded by ``queues.max_pending_stores``
  blocks (to within one batch); a write past it fails at once (counted), so
  stores never pile up behind a slow store and never delay reads (lanes serve
  reads first).
- **Events and stats.** With ``record_events`` every block a tier stored
  becomes a ``StoreEvent`` for ``take_events``; ``counters`` (cheap, any
  thread) and ``stats`` (with each tier's own counters and latencies) say what
  happened. ``close`` is bounded whatever a remote does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import threading
from collections import Counter, deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from tiercache.blocks.keys import KEY_BYTES, Namespace
from tiercache.blocks.value_format import payload_checksum
from tiercache.config.remote import RemoteTopology, load_remote_topology, remote_topology_from_dict
from tiercache.movement.lanes import Lane
from tiercache.movement.presence import PresenceCache
from tiercache.movement.reads import RemoteReader
from tiercache.movement.runtime import CLOSE_DRAIN_SECONDS, Runtime
from tiercache.remote.answers import UNKNOWN, PresenceAnswer, StoreEvent, presence_answer, resolved
from tiercache.remote.build import START_TIMEOUT_S, build_remotes, close_remotes, lane_stats, topology_namespace
from tiercache.telemetry.counters import Metrics

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 1.0
"""How long ``stats`` waits for the background loop to read the tiers' counters."""


class RemoteStore:
    """The remote tiers of one topology, for engine-owned keys and buffers (see the module docstring)."""

    def __init__(
        self, topology: RemoteTopology, namespace: Namespace, block_bytes: int, *, record_events: bool = False
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        model = topology.model
        named = dataclasses.replace(namespace, tenant_salt=namespace.tenant_salt or model.tenant,
                                    lora_id=namespace.lora_id or model.lora)
        self.namespace, codec = topology_namespace(named, model.secret_env, topology.source)
        self.topology = topology
        self.block_bytes = block_bytes
        self.root = self.namespace.root()
        self._hasher = hashlib.blake2b(digest_size=KEY_BYTES, key=self.root)
        """Keyed with the namespace root; copied per key (cheaper than keying a new one)."""
        self.metrics = Metrics()
        self.tiers, self.lanes = build_remotes(topology.tiers, codec, block_bytes, topology.queues, self.metrics)
        self.names = [tier.name for tier in self.tiers]
        """Every tier's name, fastest first."""
        self.reader = RemoteReader(self.lanes, block_bytes)
        self.runtime = Runtime(name="tiercache-remote")
        self.presence_cache = PresenceCache(self.lanes, self.runtime, key_map=self.keys)
        """Remote lookups by the engine's own keys, answered from memory (``presence``); not thread-safe."""
        self._max_pending_writes = topology.queues.max_pending_stores
        self._pending_writes = 0
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        """Guards ``_pending_writes`` and ``_counts``: the caller's thread and the loop both update them."""
        self._events: deque[StoreEvent] | None = deque() if record_events else None
        self._started = False
        self._closed = False

    @classmethod
    def from_yaml(
        cls,
        path: str | os.PathLike[str],
        namespace: Namespace,
        block_bytes: int,
        *,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        record_events: bool = False,
    ) -> RemoteStore:
        """A store over the remote-only topology in ``path`` (``overrides``: dotted field paths)."""
        return cls(load_remote_topology(path, overrides, environ), namespace, block_bytes, record_events=record_events)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], namespace: Namespace, block_bytes: int, *, record_events: bool = False
    ) -> RemoteStore:
        """A store over a remote-only topology given as a mapping (as YAML loads it)."""
        return cls(remote_topology_from_dict(data), namespace, block_bytes, record_events=record_events)

    # -- keys --------------------------------------------------------------

    def key(self, engine_key: bytes) -> bytes:
        """The tiercache key of an engine's block key inside this store's namespace."""
        digest = self._hasher.copy()
        digest.update(engine_key)
        return digest.digest()

    def keys(self, engine_keys: Sequence[bytes]) -> list[bytes]:
        """``key`` of each engine key."""
        hasher, out = self._hasher, []
        for engine_key in engine_keys:
            digest = hasher.copy()
            digest.update(engine_key)
            out.append(digest.digest())
        return out

    # -- life cycle --------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the background loop and connect the tiers (waits at most ``timeout_s``)."""
        if self._started:
            return
        self._started = True
        self.runtime.start_with(self._start_tiers(), timeout_s, "remote store")

    async def _start_tiers(self) -> None:
        await asyncio.gather(*(tier.start() for tier in self.tiers), return_exceptions=True)

    def close(self) -> None:
        """Finish or drop reads and writes in flight within ``CLOSE_DRAIN_SECONDS``, close the tiers, stop."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        try:
            self.runtime.submit(close_remotes(self.runtime, self.tiers, CLOSE_DRAIN_SECONDS), track=False).result()
        finally:
            self.runtime.stop()

    @property
    def pending(self) -> int:
        """Presence queries, reads and writes (and write-backs) not finished yet."""
        return self.runtime.pending

    def __enter__(self) -> RemoteStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the data path (any thread; results as futures) ---------------------

    # ``engine_keys=True``: ``keys`` are the engine's own block keys, mapped with ``key`` on the background loop,
    # off the caller's thread (a scheduler step then pays nothing per key); events then name them so too.

    def contains(
        self, keys: Sequence[bytes], *, engine_keys: bool = False
    ) -> concurrent.futures.Future[list[PresenceAnswer]]:
        """Per key, which tier holds it (``PresenceAnswer``); never raises, never waits."""
        return self._submit(self._contains(list(keys), engine_keys), [UNKNOWN] * len(keys))

    def presence(self, keys: Sequence[bytes], asker: Hashable, *, send: bool = False) -> list[PresenceAnswer] | None:
        """Per engine key, which tier holds it, from the presence cache (None while any is in flight); keys not
        asked before are sent at the next ``flush_presence`` (or now with ``send``). Answers are kept until
        ``forget_presence(asker)``. Call from one thread (the engine's scheduler)."""
        if not self._started or self._closed:
            return [UNKNOWN] * len(keys)
        answers = self.presence_cache.answer(keys, asker, send=send)
        return None if answers is None else [presence_answer(answers, position) for position in range(len(keys))]

    def flush_presence(self) -> None:
        """Send the keys ``presence`` was asked about since the last flush, as one ``contains`` per tier."""
        if self._started and not self._closed:
            self.presence_cache.flush()

    def forget_presence(self, asker: Hashable) -> None:
        """``asker`` (a request) is done: drop the presence answers only it kept."""
        self.presence_cache.forget(asker)

    def read(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        *,
        force_latest: bool = False,
        engine_keys: bool = False,
    ) -> concurrent.futures.Future[list[bool]]:
        """Fill ``views[i]`` with the block of ``keys[i]``; True where it was filled (and validated)."""
        if len(keys) != len(views):
            raise ValueError(f"read: {len(keys)} keys but {len(views)} buffers")
        self._check_sizes(views)
        coroutine = self._read(list(keys), list(views), force_latest, engine_keys)
        return self._submit(coroutine, [False] * len(keys))

    def write(
        self, keys: Sequence[bytes], views: Sequence[memoryview], *, engine_keys: bool = False
    ) -> concurrent.futures.Future[list[bool]]:
        """Store each buffer under its key in every tier; True where at least one tier stored it."""
        if len(keys) != len(views):
            raise ValueError(f"write: {len(keys)} keys but {len(views)} buffers")
        self._check_sizes(views)
        count = len(keys)
        if not self._reserve_writes(count):
            self._count("writes_dropped", count)
            return resolved([False] * count)
        future = self._submit(self._write(list(keys), list(views), engine_keys), [False] * count)
        future.add_done_callback(lambda _: self._write_done(count))
        return future

    def _reserve_writes(self, count: int) -> bool:
        """Count ``count`` blocks as writes in flight, unless that passes ``max_pending_stores`` while others
        are in flight (one batch larger than the bound is taken when nothing else is: the bound holds to within
        one in-flight batch, and an engine's long prompt is never refused as a whole)."""
        with self._lock:
            if self._pending_writes and self._pending_writes + count > self._max_pending_writes:
                return False
            self._pending_writes += count
            return True

    def _write_done(self, count: int) -> None:
        with self._lock:
            self._pending_writes -= count

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def _check_sizes(self, views: Sequence[memoryview]) -> None:
        for view in views:
            if view.nbytes != self.block_bytes:
                raise ValueError(f"a buffer of {view.nbytes} bytes; this store's blocks have {self.block_bytes}")

    def _submit(self, coroutine: Any, failed: list[Any]) -> concurrent.futures.Future[Any]:
        if self._closed or not self._started or not failed:
            coroutine.close()
            if failed and not self._closed:
                self._count("not_started", len(failed))
            return resolved(failed)
        return self.runtime.submit(coroutine)

    async def _contains(self, keys: list[bytes], engine_keys: bool) -> list[PresenceAnswer]:
        stored = self.keys(keys) if engine_keys else keys
        answers = await asyncio.gather(*(lane.contains(stored) for lane in self.lanes))
        found = [presence_answer(answers, position) for position in range(len(keys))]
        for presence, count in Counter(answer.presence for answer in found).items():
            self._count(f"presence_{presence.value}", count)
        return found

    async def _read(
        self, names: list[bytes], views: list[memoryview], force_latest: bool, engine_keys: bool
    ) -> list[bool]:
        keys = self.keys(names) if engine_keys else names
        read = await self.reader.read(keys, views, force_latest=force_latest)
        for tried in read.tried:
            got = [i for i in tried.positions if read.sources[i] == tried.lane.index]
            self._count(f"read_hits_{tried.lane.name}", len(got))
            depth = self.lanes.index(tried.lane)
            if got and depth > 0 and not force_latest:
                picked = [keys[i] for i in got], [views[i] for i in got], [names[i] for i in got]
                self._write_back(self.lanes[:depth], *picked)
        self._count("read_misses", read.sources.count(None))
        if read.late is not None:  # the caller may reuse its buffers once this resolves: not before the late read
            self._count("reads_late", len(read.unsettled))
            await asyncio.wait([read.late])
        return read.filled

    def _write_back(
        self, lanes: Sequence[Lane], keys: list[bytes], views: list[memoryview], names: list[bytes]
    ) -> None:
        """Write blocks read from a slower tier into the faster ones, from copies (the caller reuses its views)."""
        if not self._reserve_writes(len(keys)):
            self._count("write_backs_dropped", len(keys))
            return
        copies = [memoryview(bytes(view)) for view in views]
        checksums = [payload_checksum(copy) for copy in copies]  # while the copies' bytes are hot
        future = self.runtime.submit(self._put(lanes, keys, copies, names, checksums))
        future.add_done_callback(lambda _: self._write_done(len(keys)))

    async def _write(self, names: list[bytes], views: list[memoryview], engine_keys: bool) -> list[bool]:
        keys = self.keys(names) if engine_keys else names
        stored = await self._put(self.lanes, keys, views, names)
        self._count("writes_ok", sum(stored))
        self._count("writes_failed", len(stored) - sum(stored))
        return stored

    async def _put(
        self, lanes: Sequence[Lane], keys: list[bytes], views: list[memoryview], names: list[bytes],
        checksums: list[int | None] | None = None,
    ) -> list[bool]:
        """Put into every lane; ``names``: the keys as the caller gave them (for events). Several lanes share
        one checksum per block (hashed once, off the loop), not one each."""
        if checksums is None and sum(lane.tier.capabilities.takes_checksums for lane in lanes) > 1:
            checksums = await asyncio.to_thread(lambda: [payload_checksum(view) for view in views])
        results = await asyncio.gather(*(lane.put(keys, views, checksums) for lane in lanes))
        for lane, oks in zip(lanes, results, strict=True):
            held = tuple(name for name, ok in zip(names, oks, strict=True) if ok)
            if held and self._events is not None:
                self._events.append(StoreEvent(lane.name, held))
        return [any(column) for column in zip(*results, strict=True)] if results else [False] * len(keys)

    # -- observation ---------------------------------------------------------

    def take_events(self) -> list[StoreEvent]:
        """The ``StoreEvent``s since the last call (none unless built with ``record_events``)."""
        events: list[StoreEvent] = []
        if self._events is not None:
            while self._events:
                events.append(self._events.popleft())
        return events

    def counters(self) -> dict[str, int]:
        """This store's own counts (keys asked, ``presence_<answer>``; read hits per tier, misses, writes); cheap,
        any thread."""
        with self._lock:
            counts = Counter(self._counts)
        for presence, count in list(self.presence_cache.counts.items()):
            counts[f"presence_{presence.value}"] += count
        return dict(counts)

    def stats(self) -> dict[str, Any]:
        """``counters`` plus, per tier, its lane (breaker, latencies) and its own counters."""
        out: dict[str, Any] = {"store": self.counters(), "pending": self.pending, "tiers": {}}
        if not self._started or self._closed:
            return out
        try:
            out["tiers"] = self.runtime.submit(self._tier_stats(), track=False).result(STATS_TIMEOUT_S)
        except Exception:
            log.warning("remote store: tier stats not available within %.1f s", STATS_TIMEOUT_S)
        return out

    async def _tier_stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {}
        for lane in self.lanes:
            tiers[lane.name] = lane_stats(lane)
        for name, values in self.metrics.snapshot().items():
            tiers.setdefault(name, {}).update(values)
        return tiers
