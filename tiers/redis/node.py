"""One Redis server: its lanes (connection + I/O thread each), TLS/AUTH, capacity check, and a breaker where
its owner routes around it.

A ``Node`` serves any ``NodeOwner``: the Redis tier, and each server of the
regional tier (``tiers/regional/plane.py``), so both run one data path. Only an
owner with several servers gives a node a breaker (``server_breaker``): a Redis
Cluster's nodes, the regional tier's region and central. A single server's
breaker is its tier's lane's (``tiers/base.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, urlparse

from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.common.breaker import CircuitBreaker
from tiercache.common.units import US_PER_SECOND
from tiercache.tiers.redis.options import DEFAULT_PORT, RedisOptions, RedisServerOptions
from tiercache.tiers.redis.pipelined import PipelinedConnection, RedisJob
from tiercache.tiers.redis.resp import Connection, ConnectionFailed, ServerError

logger = logging.getLogger(__name__)

BREAKER_OPEN = "breaker_open"
"""The failure (and outcome) of a job the node's open breaker kept from being sent."""
SOCKET_BUFFER_BYTES = 4 << 20
"""SO_RCVBUF/SO_SNDBUF: room for a couple of MiB-sized values in flight."""
WRITE_LANE = 0
"""The lane every SET of a node goes down, whatever else is in flight: a server stores MiB-sized values
faster from one connection's query buffer than from two at once (two put calls of 2 MiB values kept
outstanding: +13-16% median on one lane over alternating two, faster in 18 of 20 interleaved passes;
4 MiB: 13 of 16)."""


@dataclass(frozen=True)
class Capacity:
    """What the server said about its memory bound (``denied``: why it would not say)."""

    maxmemory: int | None
    policy: str | None
    denied: str | None = None

    @property
    def bounded(self) -> bool:
        """Whether the server has a memory bound."""
        return bool(self.maxmemory)


def capacity_of(conn: Connection) -> Capacity:
    """Ask the server for maxmemory and its policy (CONFIG GET, else INFO memory).

    A server that wants credentials we did not send (``NOAUTH``) fails the
    connection with that cause; an ACL that denies both commands leaves the
    capacity unknown with the denial as the reason.
    """
    memory = conn.call(b"CONFIG", b"GET", b"maxmemory")
    if isinstance(memory, ServerError) and memory.outcome == "auth_noauth":
        raise ConnectionFailed(memory.outcome, memory.message)
    policy = conn.call(b"CONFIG", b"GET", b"maxmemory-policy")
    if isinstance(memory, list) and len(memory) == 2 and isinstance(policy, list) and len(policy) == 2:
        return Capacity(int(memory[1]), policy[1].decode())
    info = conn.call(b"INFO", b"memory")
    if not isinstance(info, bytes):
        refusals = [reply.message for reply in (memory, info) if isinstance(reply, ServerError) and reply.auth]
        return Capacity(None, None, "; ".join(refusals) or None)
    fields = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
    maxmemory = fields.get("maxmemory")
    return Capacity(int(maxmemory) if maxmemory else None, fields.get("maxmemory_policy"))


def ssl_context(options: RedisOptions) -> ssl.SSLContext:
    """The TLS context of ``rediss://`` / ``ssl: true`` (CA, client certificate, verification)."""
    context = ssl.create_default_context(cafile=options.ssl_ca)
    if options.ssl_cert:
        context.load_cert_chain(options.ssl_cert, options.ssl_key)
    if not options.ssl_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True)
class Endpoint:
    """Where ``options.url`` points and who we are there (options override the URL's credentials)."""

    host: str
    port: int
    username: str | None
    password: str | None
    db: int
    tls_context: ssl.SSLContext | None

    @classmethod
    def of(cls, options: RedisOptions) -> Endpoint:
        """The endpoint of ``options.url`` (``rediss://`` or ``ssl: true``: TLS)."""
        parsed = urlparse(options.url)
        return cls(
            parsed.hostname or "127.0.0.1",
            parsed.port or DEFAULT_PORT,
            options.username or (unquote(parsed.username) if parsed.username else None),
            options.password or (unquote(parsed.password) if parsed.password else None),
            int(parsed.path.lstrip("/") or 0),
            ssl_context(options) if options.ssl or parsed.scheme == "rediss" else None,
        )


class NodeOwner(Protocol):
    """What a ``Node`` needs from the tier it serves."""

    name: str
    options: RedisOptions
    block_bytes: int
    connections: int
    window: int
    username: str | None
    password: str | None
    db: int
    tls_context: ssl.SSLContext | None

    def note_error(self, error: str) -> None:
        """Remember the most recent error (called on the event loop)."""


def server_breaker(options: RedisServerOptions) -> CircuitBreaker:
    """The breaker of one of several servers, set by the tier's ``breaker_*`` options."""
    return CircuitBreaker(options.breaker_failures, options.breaker_backoff_s, options.breaker_backoff_max_s)


class Node:
    """One server: ``connections`` lanes, each a connection driven by its own thread, and an optional breaker."""

    def __init__(self, host: str, port: int, tier: NodeOwner, breaker: CircuitBreaker | None = None) -> None:
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self._tier = tier
        self.breaker = breaker
        """This server's own breaker, where its owner routes around it (None: the tier's lane guards it)."""
        self.lanes = [
            PipelinedConnection(f"{tier.name}-{self.address}-{i}", self._open, tier.window)
            for i in range(tier.connections)
        ]
        self._capacity_logged = False
        self._cause_logged: str | None = None
        """The cause of the error last logged (logged again only when it changes)."""

    @property
    def connects(self) -> int:
        """Connections opened so far (a reconnect after a failure counts again)."""
        return sum(lane.connects for lane in self.lanes)

    @property
    def replaced(self) -> int:
        """Connections that broke under traffic and were replaced (not counted as the server failing)."""
        return sum(lane.replaced for lane in self.lanes)

    def _open(self) -> Connection:
        """Runs in a worker thread: connect, TLS, AUTH, SELECT, capacity query."""
        tier, options = self._tier, self._tier.options
        try:
            sock = socket.create_connection((self.host, self.port), timeout=options.connect_timeout_s)
        except OSError as error:
            raise ConnectionFailed("connect", str(error)) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            if tier.tls_context is not None:
                sock = tier.tls_context.wrap_socket(sock, server_hostname=self.host)
                sock.settimeout(options.timeout_s)
            else:
                sock.settimeout(None)
                seconds = int(options.timeout_s)
                timeval = struct.pack("ll", seconds, int((options.timeout_s - seconds) * US_PER_SECOND))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            conn = Connection(sock, HEADER_SIZE + tier.block_bytes, HEADER_SIZE, tier.tls_context is not None)
            if tier.password is not None:
                credentials = [tier.password.encode()]
                if tier.username:
                    credentials.insert(0, tier.username.encode())
                reply = conn.call(b"AUTH", *credentials)
                if isinstance(reply, ServerError):
                    raise ConnectionFailed(reply.outcome if reply.auth else "auth", reply.message)
            if tier.db:
                reply = conn.call(b"SELECT", str(tier.db).encode())
                if isinstance(reply, ServerError):
                    raise ConnectionFailed(reply.outcome if reply.auth else "select", reply.message)
            conn.capacity = capacity_of(conn)
            return conn
        except BaseException:
            sock.close()
            raise

    async def call(self, job: RedisJob, lane: int = 0, *, past_breaker: bool = False) -> RedisJob:
        """Run ``job`` on lane ``lane`` (modulo the lanes); failures become its outcomes, never raise.

        While the node's breaker (if any) is open the job is not sent and fails as ``breaker_open``, unless
        ``past_breaker`` (a reachability check asks the server itself).

        If the caller is cancelled, the job is told to stop touching the caller's
        buffers and the cancel waits until the lane has let go of them.
        """
        if not job.count:
            return job
        breaker = self.breaker
        if breaker is not None and not past_breaker and not breaker.allow():
            job.outcomes[BREAKER_OPEN] += job.count
            job.failure = BREAKER_OPEN  # not asked: no answer at all, never "absent" or "no version"
            return job
        chosen = self.lanes[lane % len(self.lanes)]
        future = chosen.submit(job)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            job.cancelled = True
            await asyncio.wait([future])
            if breaker is not None:
                breaker.abandon()
            raise
        if job.failure is None:
            if breaker is not None:
                breaker.success()
            if chosen.last_connection is not None:
                self._check_capacity(chosen.last_connection)
        elif breaker is not None:
            breaker.failure()
        self._note(job.error)
        return job

    def _note(self, error: str | None) -> None:
        """Hand an error to the tier's stats; log it when its cause differs from the last one logged."""
        if error is None:
            self._cause_logged = None
            return
        self._tier.note_error(error)
        cause = error.split(" ", 1)[0]
        if cause != self._cause_logged:
            self._cause_logged = cause
            logger.warning("redis tier %s: %s: %s", self._tier.name, self.address, error)

    def _check_capacity(self, conn: Connection) -> None:
        if self._capacity_logged:
            return
        self._capacity_logged = True
        capacity, options = conn.capacity or Capacity(None, None), self._tier.options
        refused = None
        if capacity.denied is not None and not options.allow_unbounded:
            refused = (
                f"put: {self.address} does not let this user read maxmemory ({capacity.denied}); writes are "
                "refused (allow CONFIG GET or INFO for the user, or allow_unbounded: true)"
            )
        elif not capacity.bounded and not options.allow_unbounded:
            refused = (
                f"put: {self.address} has no maxmemory; writes are refused "
                "(set maxmemory with an allkeys-* policy, or allow_unbounded: true)"
            )
        if refused is not None:
            self._tier.note_error(refused)  # inspect and stats()["last_error"] name why nothing is written
            logger.error("redis tier %s: %s", self._tier.name, refused)
        elif capacity.bounded and not evicts(capacity.policy, options.ttl_s):
            logger.warning(
                "redis tier %s: %s has maxmemory-policy %s; when full, writes fail (OOM) "
                "instead of evicting old blocks",
                self._tier.name, self.address, capacity.policy,
            )

    async def close(self) -> None:
        """Stop every lane's thread and close its connection."""
        await asyncio.gather(*(lane.close() for lane in self.lanes))


def evicts(policy: str | None, ttl_s: float | None) -> bool:
    """Whether a full server with this ``maxmemory-policy`` evicts our keys (volatile-* only with a TTL)."""
    if policy is None:
        return False
    return policy.startswith("allkeys-") or (policy.startswith("volatile-") and ttl_s is not None)
