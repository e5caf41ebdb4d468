"""The regional tier's data path: central and the region each as a Redis tier ``Node``.

Value GET/SET, EXISTS, UNLINK and the bulk reads of read-through and
force_latest (values, version keys) run on the Redis tier's lanes
(``tiers/redis``): its connections, TLS/AUTH, capacity check (a region without
``maxmemory`` refuses writes unless ``allow_unbounded``) and breaker. Plain
reads take its GET fast path straight into the caller's buffers; versioned reads
also keep each hit's version and checksum from the header. The control plane
(Lua commits, refreshes and stamps, pub/sub, CONFIG) stays on redis-py
(``client``) and shares this node's breaker. Failures are outcomes, never
exceptions; their causes go to the server's ``Diagnosis``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import CHECKSUM_OFFSET, HEADER_SIZE, VERSION_OFFSET, DecodeStatus
from tiercache.common.breaker import CircuitBreaker
from tiercache.tiers.base import Presence
from tiercache.tiers.redis.commands import (
    BYTES,
    HIT,
    INVALID_OUTCOMES,
    ControlJob,
    GetJob,
    KeysJob,
    PutJob,
    ReadPlan,
)
from tiercache.tiers.redis.node import BREAKER_OPEN, WRITE_LANE, Endpoint, Node, server_breaker
from tiercache.tiers.redis.options import RedisOptions
from tiercache.tiers.redis.pipelined import RedisJob
from tiercache.tiers.redis.resp import CRLF, Connection, ServerError, command
from tiercache.tiers.redis.tier import MIN_KEYS_PER_CONNECTION
from tiercache.tiers.regional.diagnosis import Diagnosis
from tiercache.tiers.regional.versions import U64

QUIET_OUTCOMES = frozenset({HIT, BYTES, "miss", "ok", "gone"}) | INVALID_OUTCOMES
"""Outcomes that are no server failure."""


class VersionedGetJob(GetJob):
    """A GET into the destinations that also keeps each hit's version and checksum (from its header)."""

    def __init__(
        self,
        plan: ReadPlan,
        indices: list[int],
        keys: Sequence[bytes],
        names: Sequence[bytes],
        dests: Sequence[memoryview],
        results: list[bool],
        *,
        versions: list[int],
        checksums: list[bytes],
    ) -> None:
        super().__init__(plan, indices, keys, names, dests, results)
        self.versions = versions
        self.checksums = checksums

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        hits = self.hits
        super().read_reply(conn, index, pending_after)
        if self.hits != hits:
            position = self.indices[index]
            self.versions[position] = U64.unpack_from(conn.header, VERSION_OFFSET)[0]
            self.checksums[position] = bytes(conn.header[CHECKSUM_OFFSET : CHECKSUM_OFFSET + U64.size])


class EncodedPutJob(PutJob):
    """SET of values the caller encoded (``payloads`` are whole values: the regional tier replicates them)."""

    def encoded(self, position: int) -> tuple[bytes, bytes | memoryview]:
        value = self.payloads[position]
        return bytes(value[:HEADER_SIZE]), value[HEADER_SIZE:]


class ValuesJob(RedisJob):
    """GET of every name; ``values[i]`` the reply's bytes (None: absent, or an error reply)."""

    def __init__(self, names: Sequence[bytes]) -> None:
        super().__init__(len(names))
        self.names = names
        self.values: list[bytes | None] = [None] * len(names)

    def requests(self, start: int, stop: int) -> list[bytes | memoryview]:
        return [b"".join(command(b"GET", name) for name in self.names[start:stop])]

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        reply = conn.read_reply()
        if isinstance(reply, ServerError):
            self.outcomes[reply.outcome] += 1
            self.error = reply.message
        elif isinstance(reply, bytes):
            self.values[index] = reply
            self.outcomes[HIT] += 1
        else:
            self.outcomes["miss"] += 1


@dataclass
class Read:
    """What a read into the destinations found: ``results[i]`` True where ``dests[i]`` holds a valid value."""

    results: list[bool]
    invalid: list[tuple[int, DecodeStatus]]
    """Positions whose value failed validation, and why."""
    versions: list[int]
    """Each hit's version (versioned reads only)."""
    checksums: list[bytes]
    """Each hit's payload checksum bytes (versioned reads only)."""


class Plane:
    """One server's data path (a ``NodeOwner``): its ``Node``, the jobs sent to it and their outcomes."""

    def __init__(self, name: str, options: RedisOptions, codec: Codec, block_bytes: int, diagnosis: Diagnosis) -> None:
        endpoint = Endpoint.of(options)
        self.name = name
        self.options = options
        self.block_bytes = block_bytes
        self.username, self.password, self.db = endpoint.username, endpoint.password, endpoint.db
        self.tls_context = endpoint.tls_context
        self.connections = options.connections_for(block_bytes)
        self.window = options.window_for(block_bytes)
        self.codec = codec
        self.plan = ReadPlan.of(codec, block_bytes, options.stage_reads)
        self.diagnosis = diagnosis
        self.breaker: CircuitBreaker = server_breaker(options)
        """The server's breaker (the control plane's client shares it): the tier has two servers and goes on
        with one while the other is down, so each keeps its own (the lane's breaker guards the tier as a whole)."""
        self.node = Node(endpoint.host, endpoint.port, self, self.breaker)
        self.counts: Counter = Counter()
        """``{op}_{outcome}`` per key, as the Redis tier counts them."""
        self.last_error: str | None = None
        self._next_lane = 0

    def note_error(self, error: str) -> None:
        """``NodeOwner``: the most recent error, with its cause."""
        self.last_error = error

    async def _call(self, op: str, job: RedisJob, lane: int | None = None) -> RedisJob:
        """Run ``job``; count its outcomes and diagnose its failures."""
        if lane is None:
            lane = self._next_lane
            self._next_lane += 1
        job = await self.node.call(job, lane)
        for outcome, count in job.outcomes.items():
            self.counts[f"{op}_{outcome}"] += count
        if job.failure is not None:
            if job.failure != BREAKER_OPEN:  # an open breaker was diagnosed when it opened
                self.diagnosis.record_outcome(job.failure, job.error or job.failure, op)
        else:
            for outcome in job.outcomes.keys() - QUIET_OUTCOMES:
                self.diagnosis.record_outcome(outcome, job.error or outcome, op)
        return job

    async def ping(self) -> bool:
        """Connect (AUTH, capacity check) and PING; whether it answered."""
        return (await self._call("ping", ControlJob(b"PING"))).failure is None

    async def get_into(
        self, keys: Sequence[bytes], names: Sequence[bytes], dests: Sequence[memoryview], *, versioned: bool = False
    ) -> Read:
        """GET ``names`` straight into ``dests``, validated against ``keys`` (spread over the lanes)."""
        count = len(keys)
        read = Read([False] * count, [], [0] * count if versioned else [], [b""] * count if versioned else [])
        if not count:
            return read
        pieces = max(1, min(self.connections, count // MIN_KEYS_PER_CONNECTION))
        calls = []
        for piece in range(pieces):
            args = (self.plan, list(range(piece, count, pieces)), keys, names, dests, read.results)
            if versioned:
                job: GetJob = VersionedGetJob(*args, versions=read.versions, checksums=read.checksums)
            else:
                job = GetJob(*args)
            calls.append(self._call("get", job, piece))
        for done in [await calls[0]] if pieces == 1 else await asyncio.gather(*calls):
            assert isinstance(done, GetJob)
            read.invalid += done.invalid
        return read

    async def values(self, names: Sequence[bytes]) -> list[bytes | None] | None:
        """The raw value of each name (None where absent or refused); None when the server failed."""
        if not names:
            return []
        job = await self._call("read", ValuesJob(names))
        assert isinstance(job, ValuesJob)
        return None if job.failure is not None else job.values

    async def exists(self, names: Sequence[bytes]) -> list[Presence]:
        """Whether each name exists (``UNKNOWN`` where the server gave no answer)."""
        results = [Presence.UNKNOWN] * len(names)
        if names:
            await self._call("contains", KeysJob(b"EXISTS", list(range(len(names))), names, results, "miss"))
        return results

    async def set(self, keys: Sequence[bytes], names: Sequence[bytes], values: Sequence[memoryview]) -> list[bool]:
        """SET each encoded value (refused, all False, on a server without a memory bound)."""
        results = [False] * len(keys)
        if keys:
            indices = list(range(len(keys)))
            allow = self.options.allow_unbounded
            encoded = [None] * len(keys)  # the values carry their checksums in their headers already
            await self._call(
                "put", EncodedPutJob(self.codec, indices, keys, names, values, results, CRLF, allow, encoded),
                WRITE_LANE,
            )
        return results

    async def unlink(self, names: Sequence[bytes]) -> None:
        """Delete the names (best effort)."""
        if names:
            await self._call("delete", KeysJob(b"UNLINK", list(range(len(names))), names, None, "ok"))

    def stats(self, role: str) -> dict[str, float]:
        """``{role}_{op}_{outcome}`` counts, ``{role}_connects`` and ``{role}_connections_replaced``."""
        stats = {f"{role}_{name}": float(count) for name, count in self.counts.items()}
        stats[f"{role}_connects"] = float(self.node.connects)
        stats[f"{role}_connections_replaced"] = float(self.node.replaced)
        return stats

    async def close(self) -> None:
        """Stop the node's lanes."""
        await self.node.close()
