"""Central/regional sync: versions assigned at central, background replication, invalidation.

The protocol pieces under ``tiercache.tiers.regional`` (see DESIGN.md, "Central
and regional sync"):

- ``CentralStore`` commits a value with one Lua script that assigns its version,
  patches the version into the value's codec header, records it in a per-key
  version key and publishes ``key + version`` on the update channel. Versions come
  from a central clock that starts at the server's time in milliseconds times
  ``CLOCK_TICKS_PER_MS`` and then counts up, so they are monotonic per key even
  when a central store restarts empty (a new clock starts above every version
  handed out before, unless more than ``CLOCK_TICKS_PER_MS`` writes per
  millisecond were sustained). Last-writer-wins is the order of commits at
  central. The central store must keep its version keys (``noeviction`` or a
  ``volatile-*`` policy): an evicted version key turns force_latest reads of that
  key into misses, never into stale hits.
- ``RegionStore`` writes a region's copies; refreshing from central never
  overwrites a newer copy nor a copy still waiting for its version (version 0, a
  write of this region not yet replicated).
- ``Replicator`` moves a region's writes to central in the background: a bounded
  queue (a full queue drops the replication, counted; the regional copy stays),
  batches, retries with exponential back-off, then patches the assigned version
  into the regional copy.
- ``Invalidator`` listens to central's updates and drops regional copies older
  than the published version, so plain regional reads see new values early.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tiercache.breaker import BreakerState, CircuitBreaker

log = logging.getLogger(__name__)
T = TypeVar("T")

VERSION_OFFSET = struct.calcsize("<4sBBH16s16s")
"""Byte offset of the u64 version in a ``tiercache.codec`` header."""
CHECKSUM_OFFSET = VERSION_OFFSET + struct.calcsize("<QQQ")
"""Byte offset of the u64 payload checksum in a ``tiercache.codec`` header."""
U64 = struct.Struct("<Q")
CLOCK_TICKS_PER_MS = 1024
"""Versions per millisecond of the central clock's starting point (a hybrid logical clock)."""
KEY_BYTES = 16
MS_PER_SECOND = 1000.0
RESUBSCRIBE_MAX_S = 1.0
"""Longest pause between attempts to re-subscribe to central's updates."""
SUBSCRIBE_POLL_S = 0.5

_LUA_LE64 = """
local function le64(s)
  local v = 0
  for i = 8, 1, -1 do v = v * 256 + string.byte(s, i) end
  return v
end
local function pack64(v)
  local out = {}
  for i = 1, 8 do out[i] = string.char(v % 256); v = math.floor(v / 256) end
  return table.concat(out)
end
"""

COMMIT_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: clock, value, version. ARGV: value, channel, raw key, ticks per ms.
if redis.call('EXISTS', KEYS[1]) == 0 then
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', KEYS[1], string.format('%.0f', ms * tonumber(ARGV[4])))
end
local v = redis.call('INCR', KEYS[1])
local current = tonumber(redis.call('GET', KEYS[3]) or '0')
if v <= current then
  v = current + 1
  redis.call('SET', KEYS[1], string.format('%.0f', v))
end
local packed = pack64(v)
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SETRANGE', KEYS[2], {VERSION_OFFSET}, packed)
redis.call('SET', KEYS[3], string.format('%.0f', v))
redis.call('PUBLISH', ARGV[2], ARGV[3] .. packed)
return string.format('%.0f', v)
"""
)

REFRESH_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: value. ARGV: value, version. Never replaces a newer copy or an unversioned one.
local current = redis.call('GETRANGE', KEYS[1], {VERSION_OFFSET}, {VERSION_OFFSET + 7})
if #current == 8 then
  local cv = le64(current)
  if cv == 0 or cv >= tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""
)

PATCH_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: value. ARGV: checksum (8 bytes), version (8 bytes), version. Stamps our own copy only.
if redis.call('GETRANGE', KEYS[1], {CHECKSUM_OFFSET}, {CHECKSUM_OFFSET + 7}) ~= ARGV[1] then return 0 end
local cv = le64(redis.call('GETRANGE', KEYS[1], {VERSION_OFFSET}, {VERSION_OFFSET + 7}))
if cv ~= 0 and cv >= tonumber(ARGV[3]) then return 0 end
redis.call('SETRANGE', KEYS[1], {VERSION_OFFSET}, ARGV[2])
return 1
"""
)

DROP_OLDER_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: value. ARGV: version. Drops a versioned copy older than the published version.
local current = redis.call('GETRANGE', KEYS[1], {VERSION_OFFSET}, {VERSION_OFFSET + 7})
if #current == 8 then
  local cv = le64(current)
  if cv ~= 0 and cv < tonumber(ARGV[1]) then
    redis.call('DEL', KEYS[1])
    return 1
  end
end
return 0
"""
)


class SyncMode(enum.Enum):
    """Where engines read and write (DESIGN.md)."""

    CENTRAL = "central"
    """Read and write the central store directly."""
    REGIONAL = "regional"
    """Read and write the region; replicate writes to central; read through on a miss."""


def connect(url: str, timeout_s: float) -> aioredis.Redis:
    """A client that fails fast (no client-side retries): failures become misses upstream."""
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


def value_version(value: bytes) -> int:
    return U64.unpack_from(value, VERSION_OFFSET)[0]


def value_checksum(value: bytes) -> bytes:
    return bytes(value[CHECKSUM_OFFSET : CHECKSUM_OFFSET + U64.size])


class GuardedClient:
    """A Redis client behind a circuit breaker.

    Once a server is found dead, calls fail at once (misses upstream) instead of
    each waiting for its socket timeout; after a back-off one probe goes through,
    and a server that answers again is used again without a restart.
    """

    def __init__(self, client: aioredis.Redis, breaker: CircuitBreaker) -> None:
        self.client = client
        self.breaker = breaker

    async def call(self, operation: Callable[[aioredis.Redis], Awaitable[T]], failed: T) -> T:
        """``operation(client)``, or ``failed`` when the breaker refuses or the server fails."""
        if not self.breaker.allow():
            return failed
        try:
            result = await operation(self.client)
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except (RedisError, OSError):
            self.breaker.failure()
            return failed
        self.breaker.success()
        return result

    def stats(self, prefix: str) -> dict[str, float]:
        breaker = self.breaker
        return {
            f"{prefix}_breaker_state": float(breaker.state),
            f"{prefix}_breaker_open": float(breaker.state is not BreakerState.CLOSED),
            f"{prefix}_breaker_opened": float(breaker.opened),
            f"{prefix}_breaker_rejected": float(breaker.rejected),
        }

    async def aclose(self) -> None:
        await self.client.aclose()


async def _pipelined(client: aioredis.Redis, queue: Callable[[object], None]) -> list[object]:
    """Run the commands ``queue(pipe)`` adds in one non-transactional pipeline; errors stay in the list."""
    async with client.pipeline(transaction=False) as pipe:
        queue(pipe)
        return await pipe.execute(raise_on_error=False)


class _Keys:
    """Redis key names: ``{prefix}{hex}`` hash tags keep a value and its version in one slot."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.clock = f"{prefix}clock"

    def value(self, key: bytes) -> str:
        return f"{self.prefix}{{{key.hex()}}}:v"

    def version(self, key: bytes) -> str:
        return f"{self.prefix}{{{key.hex()}}}:n"


class CentralStore:
    """The central store: version assignment, version lookups, reads, the update channel."""

    def __init__(self, server: GuardedClient, prefix: str, channel: str) -> None:
        self.server = server
        self.keys = _Keys(prefix)
        self.channel = channel

    async def commit(self, items: Sequence[tuple[bytes, bytes]]) -> list[int | None]:
        """Store each (key, value) with a fresh version; the version, or None where it failed."""
        if not items:
            return []

        def queue(pipe) -> None:
            for key, value in items:
                pipe.eval(
                    COMMIT_SCRIPT,
                    3,
                    self.keys.clock,
                    self.keys.value(key),
                    self.keys.version(key),
                    value,
                    self.channel,
                    key,
                    CLOCK_TICKS_PER_MS,
                )

        replies = await self.server.call(lambda client: _pipelined(client, queue), None)
        if replies is None:
            return [None] * len(items)
        return [None if isinstance(reply, Exception) else int(reply) for reply in replies]

    async def versions(self, keys: Sequence[bytes]) -> list[int] | None:
        """The committed version of each key (0: none), or None when central is unreachable."""
        names = [self.keys.version(key) for key in keys]
        replies = await self.server.call(lambda client: client.mget(names), None)
        if replies is None:
            return None
        return [int(reply) if reply is not None else 0 for reply in replies]

    async def read(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        names = [self.keys.value(key) for key in keys]
        return await self.server.call(lambda client: client.mget(names), None)

    async def exists(self, keys: Sequence[bytes]) -> list[bool] | None:
        return await _exists(self.server, [self.keys.value(key) for key in keys])

    async def delete(self, keys: Sequence[bytes]) -> None:
        names = [self.keys.value(key) for key in keys]
        await self.server.call(lambda client: client.delete(*names), None)


class RegionStore:
    """A region's copies of central's values (and its own writes awaiting a version)."""

    def __init__(self, server: GuardedClient, prefix: str) -> None:
        self.server = server
        self.keys = _Keys(prefix)

    async def read(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        names = [self.keys.value(key) for key in keys]
        return await self.server.call(lambda client: client.mget(names), None)

    async def exists(self, keys: Sequence[bytes]) -> list[bool] | None:
        return await _exists(self.server, [self.keys.value(key) for key in keys])

    async def write(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        return await self._pipeline(items, lambda pipe, key, value: pipe.set(self.keys.value(key), value))

    async def refresh(self, items: Sequence[tuple[bytes, bytes, int]]) -> list[bool]:
        """Store copies read from central unless the region holds a newer or unversioned one."""
        return await self._pipeline(
            items, lambda pipe, key, value, version: pipe.eval(REFRESH_SCRIPT, 1, self.keys.value(key), value, version)
        )

    async def stamp(self, items: Sequence[tuple[bytes, bytes, int]]) -> list[bool]:
        """Patch central's version into our own copies (key, checksum, version)."""
        return await self._pipeline(
            items,
            lambda pipe, key, checksum, version: pipe.eval(
                PATCH_SCRIPT, 1, self.keys.value(key), checksum, U64.pack(version), version
            ),
        )

    async def drop_older(self, key: bytes, version: int) -> bool:
        name = self.keys.value(key)
        return bool(await self.server.call(lambda client: client.eval(DROP_OLDER_SCRIPT, 1, name, version), False))

    async def delete(self, keys: Sequence[bytes]) -> None:
        names = [self.keys.value(key) for key in keys]
        await self.server.call(lambda client: client.delete(*names), None)

    async def _pipeline(self, items: Sequence[tuple], queue: Callable[..., object]) -> list[bool]:
        if not items:
            return []

        def queue_all(pipe) -> None:
            for item in items:
                queue(pipe, *item)

        replies = await self.server.call(lambda client: _pipelined(client, queue_all), None)
        if replies is None:
            return [False] * len(items)
        return [not isinstance(reply, Exception) and bool(reply) for reply in replies]


async def _exists(server: GuardedClient, names: list[str]) -> list[bool] | None:
    def queue(pipe) -> None:
        for name in names:
            pipe.exists(name)

    replies = await server.call(lambda client: _pipelined(client, queue), None)
    if replies is None or any(isinstance(reply, Exception) for reply in replies):
        return None
    return [bool(reply) for reply in replies]


@dataclass
class ReplicationItem:
    """One regional write on its way to central."""

    key: bytes
    value: bytes
    checksum: bytes
    enqueued: float


class Replicator:
    """Bounded background replication of a region's writes to central, with retries.

    ``on_done(item, version)`` runs after each item settles (``version`` None when
    it was given up). Nothing raises out of the workers.
    """

    def __init__(
        self,
        central: CentralStore,
        region: RegionStore | None,
        *,
        capacity: int,
        workers: int,
        batch: int,
        retries: int,
        backoff_s: float,
        on_done: Callable[[ReplicationItem, int | None], None],
    ) -> None:
        self.central = central
        self.region = region
        self.queue: asyncio.Queue[ReplicationItem] = asyncio.Queue(capacity)
        self.batch = batch
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_done = on_done
        self.running = asyncio.Event()
        self.running.set()
        self.counters = {"replicated": 0, "replication_retries": 0, "replication_failed": 0, "replication_dropped": 0}
        self.lag_ms_total = 0.0
        self.lag_ms_max = 0.0
        self._workers = [asyncio.get_running_loop().create_task(self._work()) for _ in range(workers)]

    def offer(self, item: ReplicationItem) -> bool:
        """Queue ``item``; False (counted) when the queue is full."""
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.counters["replication_dropped"] += 1
            return False
        return True

    async def flush(self) -> None:
        """Wait until everything queued so far has been replicated or given up."""
        await self.queue.join()

    async def close(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

    async def _work(self) -> None:
        while True:
            items = [await self.queue.get()]
            while len(items) < self.batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            try:
                await self.running.wait()
                await self._replicate(items)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replication batch failed; giving it up")
                for item in items:
                    self._settle(item, None)
            finally:
                for _ in items:
                    self.queue.task_done()

    async def _replicate(self, items: list[ReplicationItem]) -> None:
        pending = items
        for attempt in range(self.retries + 1):
            if attempt:
                self.counters["replication_retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            versions = await self.central.commit([(item.key, item.value) for item in pending])
            done = [(item, v) for item, v in zip(pending, versions, strict=True) if v is not None]
            if done and self.region is not None:
                await self.region.stamp([(item.key, item.checksum, v) for item, v in done])
            for item, version in done:
                self._settle(item, version)
            pending = [item for item, v in zip(pending, versions, strict=True) if v is None]
            if not pending:
                return
        for item in pending:
            self._settle(item, None)

    def _settle(self, item: ReplicationItem, version: int | None) -> None:
        if version is None:
            self.counters["replication_failed"] += 1
        else:
            self.counters["replicated"] += 1
            lag_ms = (time.monotonic() - item.enqueued) * MS_PER_SECOND
            self.lag_ms_total += lag_ms
            self.lag_ms_max = max(self.lag_ms_max, lag_ms)
        self.on_done(item, version)


class Invalidator:
    """Subscribes to central's update channel and drops older regional copies.

    Reconnects with back-off while central is down; updates published meanwhile
    are missed, which only delays plain reads (force_latest checks versions).
    """

    def __init__(self, url: str, channel: str, region: RegionStore) -> None:
        self.url = url
        self.channel = channel
        self.region = region
        self.received = 0
        self.dropped = 0
        self.subscribed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        pause = SUBSCRIBE_POLL_S / 10
        while True:
            client = aioredis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0))
            try:
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.subscribed.set()
                    pause = SUBSCRIBE_POLL_S / 10
                    while True:
                        message = await pubsub.get_message(timeout=SUBSCRIBE_POLL_S)
                        if message is not None:
                            await self._handle(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("update channel lost; re-subscribing", exc_info=True)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(pause)
            pause = min(pause * 2, RESUBSCRIBE_MAX_S)

    async def _handle(self, data: object) -> None:
        if not isinstance(data, bytes) or len(data) != KEY_BYTES + U64.size:
            return
        key, version = data[:KEY_BYTES], U64.unpack_from(data, KEY_BYTES)[0]
        self.received += 1
        if await self.region.drop_older(key, version):
            self.dropped += 1
