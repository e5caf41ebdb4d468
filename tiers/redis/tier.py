"""``RedisTier``: batches of blocks routed to nodes, pipelined, validated (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

import xxhash

from tiercache.codec import FLAG_LZ4, HEADER_SIZE, Codec, DecodeStatus
from tiercache.tiers.base import Capabilities, RemoteContext, RemoteTier
from tiercache.tiers.redis.cluster import key_slot, slot_map
from tiercache.tiers.redis.node import BYTES, Job, Node, ssl_context
from tiercache.tiers.redis.options import DEFAULT_PORT, RedisOptions
from tiercache.tiers.redis.resp import CRLF, Connection, ConnectionFailed, ServerError, command

logger = logging.getLogger(__name__)

MIN_KEYS_PER_CONNECTION = 4
"""A batch is only spread over several connections in chunks of at least this many keys."""
CLUSTER_REFRESH_MIN_INTERVAL_S = 1.0
"""A cluster's slot map is reloaded at most this often."""
TOPOLOGY_HINTS = frozenset({"moved", "connect", "connection", "timeout", "unrouted"})
"""Outcomes after which a cluster's slot map may be stale."""
MILLISECONDS = 1000


class RedisTier(RemoteTier):
    """A Redis server or Redis Cluster as a block store (see the module docstring)."""

    capabilities = Capabilities(shared=True, versioned=False, persistent=True)
    Options = RedisOptions

    def __init__(self, context: RemoteContext, options: RedisOptions) -> None:
        super().__init__(context, options)
        self.codec = Codec(context.codec.fingerprint, compress=options.compress)
        parsed = urlparse(options.url)
        self._seed = (parsed.hostname or "127.0.0.1", parsed.port or DEFAULT_PORT)
        self.username = options.username or (unquote(parsed.username) if parsed.username else None)
        self.password = options.password or (unquote(parsed.password) if parsed.password else None)
        self.db = int(parsed.path.lstrip("/") or 0)
        use_tls = options.ssl or parsed.scheme == "rediss"
        self.tls_context = ssl_context(options) if use_tls else None
        self._prefix = options.key_prefix.encode()
        ttl = options.ttl_s
        ttl_ms = str(int(ttl * MILLISECONDS)).encode() if ttl else b""
        self._set_tail = CRLF + (b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl_ms), ttl_ms) if ttl else b"")
        self._set_parts = b"*5\r\n" if ttl else b"*3\r\n"
        self._value_bytes = HEADER_SIZE + self.block_bytes
        self._depth = max(1, options.pipeline_bytes // self._value_bytes)
        self._nodes: dict[str, Node] = {}
        self._slots: list[Node | None] = []
        self._refresh_task: asyncio.Task | None = None
        self._last_refresh = 0.0
        self._counts: Counter = Counter()

    # -- routing ---------------------------------------------------------

    def _node(self, host: str, port: int) -> Node:
        address = f"{host}:{port}"
        if address not in self._nodes:
            self._nodes[address] = Node(host, port, self)
        return self._nodes[address]

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block key (prefix + hex, so no accidental hash tags)."""
        return self._prefix + key.hex().encode()

    def _route(self, keys: Sequence[bytes]) -> tuple[dict[Node, list[int]], list[int]]:
        """Indices per node, and the indices no node owns (cluster slot uncovered)."""
        if not self.options.cluster:
            return {self._node(*self._seed): list(range(len(keys)))}, []
        groups: dict[Node, list[int]] = {}
        unrouted: list[int] = []
        for index, key in enumerate(keys):
            node = self._slots[key_slot(self.redis_key(key))] if self._slots else None
            if node is None:
                unrouted.append(index)
            else:
                groups.setdefault(node, []).append(index)
        return groups, unrouted

    def _schedule_refresh(self) -> None:
        if not self.options.cluster or (self._refresh_task and not self._refresh_task.done()):
            return
        if time.monotonic() - self._last_refresh < CLUSTER_REFRESH_MIN_INTERVAL_S:
            return
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_slots())

    async def _control(self, node: Node, *parts: bytes) -> Any:
        """One control command on ``node``; its reply, or None when the node failed."""
        reply: list[Any] = []

        def job(conn: Connection, outcomes: Counter) -> None:
            reply.append(conn.call(*parts))
            outcomes["ok"] += 1

        await node.call(job, 1)
        return reply[0] if reply else None

    async def _refresh_slots(self) -> bool:
        """Rebuild the slot map from the first node that answers ``CLUSTER SLOTS``."""
        self._last_refresh = time.monotonic()
        for node in dict.fromkeys([self._node(*self._seed), *self._nodes.values()]):
            reply = await self._control(node, b"CLUSTER", b"SLOTS")
            if not isinstance(reply, list):
                continue
            try:
                slots = slot_map(reply, node.host, self._node)
            except (TypeError, ValueError, IndexError, AttributeError):
                logger.warning("redis tier %s: malformed CLUSTER SLOTS from %s", self.name, node.address)
                continue
            self._slots = slots
            self._counts["cluster_refreshes"] += 1
            return True
        self._counts["cluster_refresh_failures"] += 1
        return False

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Connect (and, for a cluster, load the slot map); an unreachable server is not an error."""
        if self.options.cluster:
            if not await self._refresh_slots():
                logger.warning("redis tier %s: no cluster node answered at start", self.name)
            return
        node = self._node(*self._seed)
        if await self._control(node, b"PING") is None:
            logger.warning("redis tier %s: %s unreachable at start", self.name, node.address)

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
        for node in self._nodes.values():
            node.close()
        self._nodes.clear()
        self._slots = []

    # -- batched operations ---------------------------------------------

    async def _run(
        self,
        op: str,
        keys: Sequence[bytes],
        make_job: Callable[[list[int]], Job],
        spread: bool,
    ) -> None:
        """Route, split per node (and over its connections), run, count outcomes."""
        groups, unrouted = self._route(keys)
        calls = []
        for node, indices in groups.items():
            pieces = 1
            if spread:
                pieces = max(1, min(self.options.connections, len(indices) // MIN_KEYS_PER_CONNECTION))
            for piece in range(pieces):
                chunk = indices[piece::pieces]
                calls.append(node.call(make_job(chunk), len(chunk)))
        outcomes: Counter = Counter(unrouted=len(unrouted)) if unrouted else Counter()
        for result in await asyncio.gather(*calls):
            outcomes.update(result)
        moved = outcomes.pop(BYTES, 0)
        if moved:
            self._counts["bytes_read" if op == "get" else "bytes_written"] += moved
        for outcome, count in outcomes.items():
            self._counts[f"{op}_{outcome}"] += count
        if self.options.cluster and outcomes.keys() & TOPOLOGY_HINTS:
            self._schedule_refresh()

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        results = [False] * len(keys)
        if keys:
            await self._run("get", keys, lambda chunk: self._get_job(chunk, keys, dests, results), True)
        return results

    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        results = [False] * len(keys)
        if keys:
            await self._run("put", keys, lambda chunk: self._put_job(chunk, keys, payloads, results), True)
        return results

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        results = [False] * len(keys)
        if keys:
            await self._run("contains", keys, lambda chunk: self._exists_job(chunk, keys, results), False)
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self._run("delete", keys, lambda chunk: self._delete_job(chunk, keys), False)

    # -- worker-thread jobs (each returns outcome counts) ----------------

    def _get_job(
        self, chunk: list[int], keys: Sequence[bytes], dests: Sequence[memoryview], results: list[bool]
    ) -> Job:
        requests = [command(b"GET", self.redis_key(keys[i])) for i in chunk]

        def job(conn: Connection, outcomes: Counter) -> None:
            def handle(j: int) -> None:
                index = chunk[j]
                outcome = self._read_value(conn, keys[index], memoryview(dests[index]).cast("B"))
                results[index] = outcome == "hit"
                outcomes[outcome] += 1
                if outcome == "hit":
                    outcomes[BYTES] += self.block_bytes

            conn.pipeline(len(chunk), self._depth, lambda j: [requests[j]], handle)

        return job

    def _read_value(self, conn: Connection, key: bytes, dest: memoryview) -> str:
        """Read one GET reply and, if valid, its payload into ``dest``; return the outcome."""
        line = conn.read_line()
        if line[:1] == b"-":
            return ServerError(line[1:].decode(errors="replace")).outcome
        if line[:1] != b"$":
            raise ConnectionFailed("protocol", f"unexpected GET reply {line[:40]!r}")
        length = int(line[1:])
        if length < 0:
            return "miss"
        staging = conn.staging
        if length > len(staging):
            conn.skip(length)
            conn.expect_crlf()
            return DecodeStatus.BAD_LENGTH.value
        direct = not self.options.stage_reads and length == HEADER_SIZE + len(dest)
        if not direct:
            conn.read_into(staging[:length])
            conn.expect_crlf()
            return self._decoded(self.codec.decode_into(key, staging[:length], dest).status)
        conn.read_into(staging[:HEADER_SIZE])
        header = self.codec.parse_header(key, staging[:length])
        if isinstance(header, DecodeStatus):
            conn.skip(length - HEADER_SIZE)
            conn.expect_crlf()
            return header.value
        if header.flags & FLAG_LZ4:
            conn.read_into(staging[HEADER_SIZE:length])
            conn.expect_crlf()
            return self._decoded(self.codec.decode_into(key, staging[:length], dest).status)
        conn.read_into(dest)
        conn.expect_crlf()
        if header.raw_length != len(dest):
            return DecodeStatus.BAD_LENGTH.value
        # The codec's checksum (xxh3-64 of the stored payload), computed where the payload landed.
        if xxhash.xxh3_64_intdigest(dest) != header.checksum:
            return DecodeStatus.BAD_CHECKSUM.value
        return "hit"

    @staticmethod
    def _decoded(status: DecodeStatus) -> str:
        return "hit" if status is DecodeStatus.OK else status.value

    def _put_job(
        self, chunk: list[int], keys: Sequence[bytes], payloads: Sequence[memoryview], results: list[bool]
    ) -> Job:
        sizes: dict[int, int] = {}

        def job(conn: Connection, outcomes: Counter) -> None:
            if not (conn.capacity and conn.capacity.bounded) and not self.options.allow_unbounded:
                outcomes["refused_unbounded"] += len(chunk)
                return

            def request(j: int) -> list[bytes | memoryview]:
                key = keys[chunk[j]]
                header, stored = self.codec.encode(key, payloads[chunk[j]])
                rkey = self.redis_key(key)
                size = len(header) + len(stored)
                sizes[j] = size
                prefix = b"%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (self._set_parts, len(rkey), rkey, size)
                return [prefix, header, stored, self._set_tail]

            def handle(j: int) -> None:
                reply = conn.read_reply()
                ok = reply == b"OK"
                results[chunk[j]] = ok
                outcomes["ok" if ok else getattr(reply, "outcome", "server_error")] += 1
                if ok:
                    outcomes[BYTES] += sizes[j]

            conn.pipeline(len(chunk), self._depth, request, handle)

        return job

    def _exists_job(
        self, chunk: list[int], keys: Sequence[bytes], results: list[bool]
    ) -> Job:
        requests = [command(b"EXISTS", self.redis_key(keys[i])) for i in chunk]

        def job(conn: Connection, outcomes: Counter) -> None:
            def handle(j: int) -> None:
                reply = conn.read_reply()
                results[chunk[j]] = reply == 1
                outcomes["hit" if reply == 1 else getattr(reply, "outcome", "miss")] += 1

            conn.pipeline(len(chunk), len(chunk), lambda j: [requests[j]], handle)

        return job

    def _delete_job(self, chunk: list[int], keys: Sequence[bytes]) -> Job:
        requests = [command(b"UNLINK", self.redis_key(keys[i])) for i in chunk]

        def job(conn: Connection, outcomes: Counter) -> None:
            def handle(j: int) -> None:
                reply = conn.read_reply()
                outcomes[getattr(reply, "outcome", "ok")] += 1

            conn.pipeline(len(chunk), len(chunk), lambda j: [requests[j]], handle)

        return job

    # -- stats -------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """``<op>_<outcome>`` counts per block, hits/misses, bytes, breaker and connection state."""
        out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
        hits = self._counts["get_hit"]
        gets = sum(v for k, v in self._counts.items() if k.startswith("get_"))
        out["hits"] = float(hits)
        out["misses"] = float(gets - hits)
        out["bytes_read"] = float(self._counts["bytes_read"])
        out["bytes_written"] = float(self._counts["bytes_written"])
        breakers = [node.breaker for node in self._nodes.values()]
        out["nodes"] = float(len(self._nodes))
        out["breaker_open_nodes"] = float(sum(b.state != 0 for b in breakers))
        out["breaker_state"] = float(max((b.state for b in breakers), default=0))
        out["breaker_opened"] = float(sum(b.opened for b in breakers))
        out["breaker_rejected"] = float(sum(b.rejected for b in breakers))
        out["connects"] = float(sum(node.connects for node in self._nodes.values()))
        return out
