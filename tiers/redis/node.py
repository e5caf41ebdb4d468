"""One Redis server: a breaker, a pool of connections with worker threads, TLS/AUTH, capacity check."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.breaker import CircuitBreaker
from tiercache.codec import HEADER_SIZE
from tiercache.tiers.redis.options import RedisOptions
from tiercache.tiers.redis.resp import Connection, ConnectionFailed, ServerError

if TYPE_CHECKING:
    from tiercache.tiers.redis.tier import RedisTier

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
"""SO_RCVBUF/SO_SNDBUF: room for a couple of MiB-sized values in flight."""
MICROSECONDS = 1_000_000
BYTES = "bytes"
"""Outcome counters carry the payload bytes moved under this name."""


@dataclass(frozen=True)
class Capacity:
    """What the server said about its memory bound."""

    maxmemory: int | None
    policy: str | None

    @property
    def bounded(self) -> bool:
        return bool(self.maxmemory)


def capacity_of(conn: Connection) -> Capacity:
    """Ask the server for maxmemory and its policy (CONFIG GET, else INFO memory)."""
    memory = conn.call(b"CONFIG", b"GET", b"maxmemory")
    policy = conn.call(b"CONFIG", b"GET", b"maxmemory-policy")
    if isinstance(memory, list) and len(memory) == 2 and isinstance(policy, list) and len(policy) == 2:
        return Capacity(int(memory[1]), policy[1].decode())
    info = conn.call(b"INFO", b"memory")
    if not isinstance(info, bytes):
        return Capacity(None, None)
    fields = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
    maxmemory = fields.get("maxmemory")
    return Capacity(int(maxmemory) if maxmemory else None, fields.get("maxmemory_policy"))


def ssl_context(options: RedisOptions) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=options.ssl_ca)
    if options.ssl_cert:
        context.load_cert_chain(options.ssl_cert, options.ssl_key)
    if not options.ssl_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


Job = Callable[[Connection, Counter], None]
"""Work for one connection, run in its worker thread; it counts outcomes as it goes."""


def guard(work: Callable[[], None]) -> str | None:
    """Thread side: run ``work``; return the failure kind (None if it succeeded), never raise."""
    try:
        work()
        return None
    except ConnectionFailed as error:
        return error.kind
    except (TimeoutError, BlockingIOError):
        return "timeout"
    except OSError:
        return "connection"
    except Exception:
        logger.exception("redis tier: unexpected error in a worker thread")
        return "internal"


class Node:
    """One server: a breaker, a pool of connections, and a worker thread per connection."""

    def __init__(self, host: str, port: int, tier: RedisTier) -> None:
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self._tier = tier
        options = tier.options
        self.breaker = CircuitBreaker(
            options.breaker_failures, options.breaker_backoff_s, options.breaker_backoff_max_s
        )
        self._idle: list[Connection] = []
        self._slots = asyncio.Semaphore(options.connections)
        self._executor = ThreadPoolExecutor(options.connections, thread_name_prefix=f"tiercache-{tier.name}")
        self._capacity_logged = False
        self.connects = 0

    def _open(self) -> Connection:
        """Runs in a worker thread: connect, TLS, AUTH, SELECT, capacity probe."""
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
                timeval = struct.pack("ll", seconds, int((options.timeout_s - seconds) * MICROSECONDS))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            conn = Connection(sock, HEADER_SIZE + tier.block_bytes, tier.tls_context is not None)
            if tier.password is not None:
                credentials = [tier.password.encode()]
                if tier.username:
                    credentials.insert(0, tier.username.encode())
                reply = conn.call(b"AUTH", *credentials)
                if isinstance(reply, ServerError):
                    raise ConnectionFailed("auth", reply.message)
            if tier.db:
                reply = conn.call(b"SELECT", str(tier.db).encode())
                if isinstance(reply, ServerError):
                    raise ConnectionFailed("auth", reply.message)
            conn.capacity = capacity_of(conn)
            return conn
        except BaseException:
            sock.close()
            raise

    async def call(self, job: Job, keys: int) -> Counter:
        """Run ``job`` on a pooled connection in a worker thread; failures become outcomes.

        The job counts a per-key outcome as it goes; when the connection fails
        part-way, the keys it did not reach are counted under the failure's kind.
        """
        outcomes: Counter = Counter()
        if not self.breaker.allow():
            outcomes["breaker_open"] = keys
            return outcomes
        loop = asyncio.get_running_loop()
        async with self._slots:
            pooled = self._idle.pop() if self._idle else None
            opened: list[Connection] = []

            def work() -> None:
                if pooled is None:
                    opened.append(self._open())
                job(pooled or opened[0], outcomes)

            future = loop.run_in_executor(self._executor, guard, work)
            try:
                failure = await asyncio.shield(future)
            except asyncio.CancelledError:
                for live in (pooled, *opened):
                    if live is not None:
                        live.abort()
                await asyncio.wait([future])
                for live in (pooled, *opened):
                    if live is not None:
                        live.close()
                self.breaker.abandon()
                raise
            used = pooled or (opened[0] if opened else None)
            self.connects += len(opened)
            if failure is None and used is not None:
                self.breaker.success()
                self._idle.append(used)
                self._check_capacity(used)
            else:
                self.breaker.failure()
                if used is not None:
                    used.close()
                outcomes[failure or "internal"] += keys - (sum(outcomes.values()) - outcomes[BYTES])
            return outcomes

    def _check_capacity(self, conn: Connection) -> None:
        if self._capacity_logged:
            return
        self._capacity_logged = True
        capacity, options = conn.capacity or Capacity(None, None), self._tier.options
        if not capacity.bounded and not options.allow_unbounded:
            logger.error(
                "redis tier %s: %s has no maxmemory (or hides it); writes are refused "
                "(set maxmemory with an allkeys-* policy, or allow_unbounded: true)",
                self._tier.name, self.address,
            )
        elif capacity.bounded and not evicts(capacity.policy, options.ttl_s):
            logger.warning(
                "redis tier %s: %s has maxmemory-policy %s; when full, writes fail (OOM) "
                "instead of evicting old blocks",
                self._tier.name, self.address, capacity.policy,
            )

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        self._executor.shutdown(wait=False)


def evicts(policy: str | None, ttl_s: float | None) -> bool:
    if policy is None:
        return False
    return policy.startswith("allkeys-") or (policy.startswith("volatile-") and ttl_s is not None)
