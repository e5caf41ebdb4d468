"""``RedisTier``: batches of blocks routed to nodes and handed to their lanes (see the package docstring)."""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from tiercache.common.units import MS_PER_SECOND
from tiercache.tiers.base import (
    BreakerSettings,
    Capabilities,
    Presence,
    RemoteContext,
    RemoteTier,
    ServerReachability,
    known_checksums,
    outcome_stats,
)
from tiercache.tiers.redis.cluster import key_slot, slot_map
from tiercache.tiers.redis.commands import BYTES, ControlJob, GetJob, KeysJob, PutJob, ReadPlan
from tiercache.tiers.redis.evictions import EvictionWatcher
from tiercache.tiers.redis.node import BREAKER_OPEN, WRITE_LANE, Endpoint, Node, server_breaker
from tiercache.tiers.redis.options import RedisOptions
from tiercache.tiers.redis.pipelined import RedisJob
from tiercache.tiers.redis.resp import CRLF, ServerError

logger = logging.getLogger(__name__)

MIN_KEYS_PER_CONNECTION = 4
"""A batch is only spread over several connections in chunks of at least this many keys."""
CLUSTER_REFRESH_MIN_INTERVAL_S = 1.0
"""A cluster's slot map is reloaded at most this often."""
TOPOLOGY_HINTS = frozenset({"moved", "connect", "connection", "timeout", "unrouted"})
"""Outcomes after which a cluster's slot map may be stale."""
DATA_PATH_OPS = frozenset({"get", "put", "contains", "delete"})
"""The operations a lane calls, whose server failures its breaker hears (``RemoteTier.server_failed``)."""


class RedisTier(RemoteTier):
    """A Redis server or Redis Cluster as a block store (see the package docstring)."""

    capabilities = Capabilities(
        shared=True, versioned=False, persistent=True, reports_evictions=True, takes_checksums=True
    )
    Options = RedisOptions

    def __init__(self, context: RemoteContext, options: RedisOptions) -> None:
        super().__init__(context, options)
        self.codec = context.codec.variant(compress=options.compress)
        endpoint = Endpoint.of(options)
        self._seed = (endpoint.host, endpoint.port)
        self.username, self.password, self.db = endpoint.username, endpoint.password, endpoint.db
        self.tls_context = endpoint.tls_context
        self._prefix = options.key_prefix.encode()
        ttl = options.ttl_s
        ttl_ms = str(int(ttl * MS_PER_SECOND)).encode() if ttl else b""
        self._set_tail = CRLF + (b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl_ms), ttl_ms) if ttl else b"")
        self.connections = options.connections_for(self.block_bytes)
        """Lanes (connection + I/O thread) per node."""
        self.window = options.window_for(self.block_bytes)
        """Requests in flight per lane."""
        self._plan = ReadPlan.of(self.codec, self.block_bytes, options.stage_reads)
        self._nodes: dict[str, Node] = {}
        self._slots: list[Node | None] = []
        self._refresh_task: asyncio.Task | None = None
        self._last_refresh = 0.0
        self._counts: Counter = Counter()
        self._next_lane = 0
        """Calls that are not spread over a node's lanes take them in turn."""
        self._watcher: EvictionWatcher | None = None

    # -- routing ---------------------------------------------------------

    def breaker_settings(self) -> BreakerSettings:
        """The lane's breaker is this tier's: set by the ``breaker_*`` options."""
        options = self.options
        return BreakerSettings(options.breaker_failures, options.breaker_backoff_s, options.breaker_backoff_max_s)

    def _node(self, host: str, port: int) -> Node:
        """The node of ``host:port``; a cluster's nodes each get a breaker (the slots of a dead one are skipped
        while the others are served), a single server none (its tier's lane guards it)."""
        address = f"{host}:{port}"
        if address not in self._nodes:
            breaker = server_breaker(self.options) if self.options.cluster else None
            self._nodes[address] = Node(host, port, self, breaker)
        return self._nodes[address]

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block key (prefix + hex, so no accidental hash tags)."""
        return self._prefix + binascii.hexlify(key)

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
        job = await node.call(ControlJob(*parts))
        return job.reply if job.failure is None else None

    def redis_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """``redis_key`` of every key."""
        prefix, hexlify = self._prefix, binascii.hexlify
        return [prefix + hexlify(key) for key in keys]

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
        else:
            await self._node(*self._seed).call(ControlJob(b"PING"))  # a failure is logged with its cause
        await self._watch_evictions()

    async def _watch_evictions(self) -> None:
        """Hear the server's own evictions and expiries (``evictions.py``) when someone listens for them."""
        if not self.options.notify_evictions or not self._eviction_listeners:
            return
        nodes = [(node.host, node.port) for node in self._nodes.values()] or [self._seed]
        self._watcher = EvictionWatcher(
            self.name, self.options, nodes, self._prefix, self.db, self.report_evicted, self._counts
        )
        await self._watcher.start(self.options.connect_timeout_s)

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        await super().close()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
        await asyncio.gather(*(node.close() for node in self._nodes.values()))
        self._nodes.clear()
        self._slots = []

    async def check_reachability(self, key: bytes) -> list[ServerReachability]:
        """A cluster's masters (the seed node while no slot map is known), each on its own: connected (TLS,
        AUTH) and PINGed. A single server: none apart (the default), the tier's own calls speak for it."""
        if not self.options.cluster:
            return []
        nodes = list(dict.fromkeys(node for node in self._slots if node is not None)) or [self._node(*self._seed)]
        jobs = await asyncio.gather(*(node.call(ControlJob(b"PING"), past_breaker=True) for node in nodes))
        return [_node_reachability(node, job) for node, job in zip(nodes, jobs, strict=True)]

    # -- batched operations ---------------------------------------------

    async def _run(
        self, op: str, keys: Sequence[bytes], make_job: Callable[[list[int]], RedisJob], spread: bool,
        lane: int | None = None,
    ) -> list[RedisJob]:
        """Route, split per node (and over its lanes if ``spread``, else on ``lane``, or each lane in turn
        when None), run, count outcomes; the jobs run."""
        groups, unrouted = self._route(keys)
        calls, sent_to = [], []
        for node, indices in groups.items():
            if spread:
                pieces = max(1, min(self.connections, len(indices) // MIN_KEYS_PER_CONNECTION))
                for piece in range(pieces):
                    calls.append(node.call(make_job(indices[piece::pieces]), piece))
                    sent_to.append(node)
            else:
                calls.append(node.call(make_job(indices), self._next_lane if lane is None else lane))
                sent_to.append(node)
        self._next_lane += 1
        outcomes: Counter = Counter(unrouted=len(unrouted)) if unrouted else Counter()
        jobs = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
        for job in jobs:
            outcomes.update(job.outcomes)
        if op in DATA_PATH_OPS:
            self._tell_failure(sent_to, jobs)
        moved = outcomes.pop(BYTES, 0)
        if moved:
            self._counts["bytes_read" if op == "get" else "bytes_written"] += moved
        for outcome, count in outcomes.items():
            self._counts[f"{op}_{outcome}"] += count
        if self.options.cluster and outcomes.keys() & TOPOLOGY_HINTS:
            self._schedule_refresh()
        return jobs

    def _tell_failure(self, nodes: Sequence[Node], jobs: Sequence[RedisJob]) -> None:
        """Tell the lane's breaker that the call failed (``server_failed``) when every node asked failed a part
        of it and one of them was really asked (not only refused by its own open breaker): a single server, any
        failed job; a cluster, no node answering (one dead node costs only its slots, its breaker skips it)."""
        failed = {node for node, job in zip(nodes, jobs, strict=True) if job.failure is not None}
        causes = [job.failure for job in jobs if job.failure not in (None, BREAKER_OPEN)]
        if causes and failed == set(nodes):
            self.server_failed(causes[0])

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        results = [False] * len(keys)
        if keys:
            rkeys = self.redis_keys(keys)
            jobs = await self._run(
                "get", keys, lambda chunk: GetJob(self._plan, chunk, keys, rkeys, dests, results), True
            )
            self.invalid_values.report(
                (keys[i], status) for job in jobs if isinstance(job, GetJob) for i, status in job.invalid
            )
        return results

    async def delete_damaged(self, items: list[bytes]) -> int:
        """UNLINK values a read proved damaged, so that the next store of those blocks rewrites them.

        Off the read's path and best-effort: a failure is counted like any
        delete's (``invalid_delete_<outcome>``); returns the values removed. A
        value rewritten since it was read is removed too: a lost block, never a
        wrong one.
        """
        rkeys = self.redis_keys(items)
        held = [Presence.UNKNOWN] * len(items)  # UNLINK answers 1 where the key was there (and is now removed)
        await self._run("invalid_delete", items, lambda chunk: KeysJob(b"UNLINK", chunk, rkeys, held, "gone"), False)
        return held.count(Presence.HELD)

    async def put(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        results = [False] * len(keys)
        if keys:
            rkeys = self.redis_keys(keys)
            allow = self.options.allow_unbounded
            sums = known_checksums(checksums, len(keys))

            def make(chunk: list[int]) -> RedisJob:
                return PutJob(self.codec, chunk, keys, rkeys, payloads, results, self._set_tail, allow, sums)

            await self._run("put", keys, make, False, WRITE_LANE)
        return results

    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        results = [Presence.UNKNOWN] * len(keys)
        if keys:
            rkeys = self.redis_keys(keys)
            await self._run("contains", keys, lambda chunk: KeysJob(b"EXISTS", chunk, rkeys, results, "miss"), False)
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            rkeys = self.redis_keys(keys)
            await self._run("delete", keys, lambda chunk: KeysJob(b"UNLINK", chunk, rkeys, None, "ok"), False)

    # -- stats -------------------------------------------------------------

    def tier_stats(self) -> dict[str, float]:
        """``<op>_<outcome>`` counts per block, hits/misses, bytes, connection state and, for a cluster, its
        nodes' breakers (``breaker_*``; a single server's breaker is its lane's: ``lane_breaker_*``)."""
        out = outcome_stats(self._counts)
        out["nodes"] = float(len(self._nodes))
        if self.options.cluster:
            breakers = [node.breaker for node in self._nodes.values() if node.breaker is not None]
            out["breaker_open_nodes"] = float(sum(b.state != 0 for b in breakers))
            out["breaker_state"] = float(max((b.state for b in breakers), default=0))
            out["breaker_opened"] = float(sum(b.opened for b in breakers))
            out["breaker_rejected"] = float(sum(b.rejected for b in breakers))
        out["connects"] = float(sum(node.connects for node in self._nodes.values()))
        out["connections_replaced"] = float(sum(node.replaced for node in self._nodes.values()))
        return out


def _node_reachability(node: Node, ping: ControlJob) -> ServerReachability:
    """What a PING of one cluster node says of it."""
    if ping.failure is None and not isinstance(ping.reply, ServerError):
        return ServerReachability("node", node.address, True, "PING ok")
    cause = ping.reply.message if isinstance(ping.reply, ServerError) else ping.error or ping.failure
    return ServerReachability("node", node.address, False, f"PING failed: {cause}")
