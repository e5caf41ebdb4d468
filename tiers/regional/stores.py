"""The two kinds of store a regional tier talks to, as operations on blocks.

- ``CentralStore`` commits values with central versions (``versions.COMMIT_SCRIPT``:
  one Lua call assigns the version, patches it into the value's header, records
  it in a per-key version key and publishes ``key + version`` on the update
  channel), frees room when a full central refuses commits (``room``), and
  answers version lookups and reads.
- ``RegionStore`` holds a region's copies: refreshing from central never
  overwrites a newer copy nor a copy still waiting for its version (version 0,
  a write of this region not yet replicated).

Reads, writes, EXISTS and deletes go through the server's ``Plane`` (the Redis
tier's data path); Lua scripts and CONFIG through its ``GuardedClient``
(redis-py). Either way a failure is a ``None`` / ``False`` answer, never an
exception.
"""

from __future__ import annotations

import binascii
import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence

from tiercache.tiers.base import Presence
from tiercache.tiers.regional.client import GuardedClient, pipelined
from tiercache.tiers.regional.diagnosis import Cause, classify
from tiercache.tiers.regional.plane import Plane, Read
from tiercache.tiers.regional.room import Room
from tiercache.tiers.regional.versions import (
    CLOCK_TICKS_PER_MS,
    COMMIT_SCRIPT,
    DELETE_IF_SAME_SCRIPT,
    DROP_OLDER_SCRIPT,
    PATCH_SCRIPT,
    REFRESH_SCRIPT,
    U64,
    parse_version,
)

Invalid = Callable[[bytes, bytes], bool]
"""Whether a value read for a key fails validation (``discard_invalid`` deletes only those)."""
Damaged = tuple["CentralStore | RegionStore", bytes, "bytes | None"]
"""A value a read found invalid: the store it came from, its key, and the value when read whole."""


class _Keys:
    """Redis key names: ``{prefix}{hex}`` hash tags keep a value and its version in one slot."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.clock = f"{prefix}clock"

    def value(self, key: bytes) -> str:
        return f"{self.prefix}{{{key.hex()}}}:v"

    def version(self, key: bytes) -> str:
        return f"{self.prefix}{{{key.hex()}}}:n"

    def values(self, keys: Sequence[bytes]) -> list[bytes]:
        """``value`` of every key, as the data path sends them."""
        prefix, hexlify = self.prefix.encode() + b"{", binascii.hexlify
        return [prefix + hexlify(key) + b"}:v" for key in keys]


class _Store:
    """What central and a region share: reads, EXISTS, deletes and the removal of invalid values."""

    def __init__(self, server: GuardedClient, plane: Plane, prefix: str) -> None:
        self.server = server
        self.plane = plane
        self.keys = _Keys(prefix)

    async def read(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        """The raw values (None where absent), or None when the server failed."""
        return await self.plane.values(self.keys.values(keys))

    async def get_into(self, keys: Sequence[bytes], dests: Sequence[memoryview], *, versioned: bool = False) -> Read:
        """Read the values straight into ``dests`` (``versioned``: keep each hit's version and checksum)."""
        return await self.plane.get_into(keys, self.keys.values(keys), dests, versioned=versioned)

    async def exists(self, keys: Sequence[bytes]) -> list[Presence]:
        return await self.plane.exists(self.keys.values(keys))

    async def delete(self, keys: Sequence[bytes]) -> None:
        await self.plane.unlink(self.keys.values(keys))

    async def discard(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete values that failed validation (key, value as read); how many were deleted."""
        return await _discard(self.server, [(self.keys.value(key), value) for key, value in items])

    async def discard_invalid(self, keys: Sequence[bytes], invalid: Invalid) -> int:
        """Read ``keys`` again and delete the values that still fail validation (unless rewritten meanwhile)."""
        values = await self.read(keys) or []
        pairs = zip(keys, values, strict=False)
        return await self.discard([(key, value) for key, value in pairs if value is not None and invalid(key, value)])


class CentralStore(_Store):
    """The central store: version assignment, version lookups, reads, the update channel."""

    def __init__(self, server: GuardedClient, plane: Plane, prefix: str, channel: str, ttl_ms: int = 0) -> None:
        super().__init__(server, plane, prefix)
        self.channel = channel
        self.ttl_ms = ttl_ms
        """Expiry of committed values and version keys (0: none)."""
        self.commit_failed = 0
        """Values whose commit failed (server unreachable, OOM, ACL...); the cause is in the diagnosis."""
        self.room = Room(server, prefix)
        """Frees room when central is full and does not evict (``room``)."""

    async def commit(self, items: Sequence[tuple[bytes, bytes]]) -> list[int | None]:
        """Store each (key, value) with a fresh version; the version, or None where it failed.

        What a full central refused (OOM) is committed again once ``room`` has freed space.
        """
        if not items:
            return []
        versions, full = await self._commit(items)
        if full and await self.room.make(len(full), sum(len(items[i][1]) for i in full)):
            again, _ = await self._commit([items[i] for i in full])
            for i, version in zip(full, again, strict=True):
                versions[i] = version
        self.commit_failed += versions.count(None)
        return versions

    async def _commit(self, items: Sequence[tuple[bytes, bytes]]) -> tuple[list[int | None], list[int]]:
        """One pipelined commit: the versions (None where it failed) and the positions refused for memory."""

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
                    self.ttl_ms,
                )

        replies = await self.server.call(lambda client: pipelined(client, queue), None, "commit")
        self.server.check_replies(replies, "commit")
        if replies is None:
            return [None] * len(items), []
        versions = [None if isinstance(reply, Exception) else parse_version(reply) or None for reply in replies]
        full = [i for i, reply in enumerate(replies) if isinstance(reply, Exception) and classify(reply) is Cause.OOM]
        return versions, full

    async def memory_policy(self) -> tuple[int, str] | None:
        """Central's ``maxmemory`` and ``maxmemory-policy``, or None when it cannot tell (down, ACL, hidden)."""
        config = await self.server.call(lambda client: client.config_get("maxmemory*"), None, "CONFIG GET")
        if not config or "maxmemory" not in config or "maxmemory-policy" not in config:
            return None
        return int(config["maxmemory"]), str(config["maxmemory-policy"])

    async def versions(self, keys: Sequence[bytes]) -> list[int | None] | None:
        """The committed version of each key (0: none; None: a garbage version key), or None when unreachable."""
        replies = await self.plane.values([self.keys.version(key).encode() for key in keys])
        if replies is None:
            return None
        return [parse_version(reply) for reply in replies]


class RegionStore(_Store):
    """A region's copies of central's values (and its own writes awaiting a version)."""

    async def write(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """SET each (key, encoded value) through the data path."""
        keys = [key for key, _ in items]
        return await self.plane.set(keys, self.keys.values(keys), [memoryview(value) for _, value in items])

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

    async def _pipeline(self, items: Sequence[tuple], queue: Callable[..., object]) -> list[bool]:
        if not items:
            return []

        def queue_all(pipe) -> None:
            for item in items:
                queue(pipe, *item)

        replies = await self.server.call(lambda client: pipelined(client, queue_all), None, "write")
        self.server.check_replies(replies, "write")
        if replies is None:
            return [False] * len(items)
        return [not isinstance(reply, Exception) and bool(reply) for reply in replies]


async def discard_damaged(items: Sequence[Damaged], still_damaged: Invalid) -> int:
    """Delete damaged values from the store each was read from, unless rewritten since; how many were.

    A value read whole is deleted only while it is still that value; one read
    straight into a buffer is read again and deleted only if ``still_damaged``.
    """
    read_whole: dict[CentralStore | RegionStore, list[tuple[bytes, bytes]]] = defaultdict(list)
    read_again: dict[CentralStore | RegionStore, list[bytes]] = defaultdict(list)
    for store, key, value in items:
        if value is None:
            read_again[store].append(key)
        else:
            read_whole[store].append((key, value))
    removed = 0
    for store, pairs in read_whole.items():
        removed += await store.discard(pairs)
    for store, keys in read_again.items():
        removed += await store.discard_invalid(keys, invalid=still_damaged)
    return removed


async def _discard(server: GuardedClient, items: list[tuple[str, bytes]]) -> int:
    """Delete each (name, value) unless the value was replaced since it was read (compared by SHA-1)."""
    if not items:
        return 0

    def queue(pipe) -> None:
        for name, value in items:
            pipe.eval(DELETE_IF_SAME_SCRIPT, 1, name, hashlib.sha1(value).hexdigest())

    replies = await server.call(lambda client: pipelined(client, queue), None)
    return sum(reply == 1 for reply in replies or [])
