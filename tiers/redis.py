"""Redis / Valkey / Redis Cluster tier: one key per block, value = codec header + payload.

Why its own RESP client. A block is tens of KiB to MiBs; redis-py builds a
Python ``bytes`` per reply and the caller copies it again, which on loopback
reads at a fraction of what the server can send. Here each node has a small
pool of blocking sockets, each driven by its own worker thread (coroutines
await the thread; the event loop never blocks), that pipelines requests and
parses replies in place:

* ``SET`` sends ``header`` and ``payload`` with one ``sendmsg`` of the caller's
  buffers (no concatenation), as ONE command, so a reader sees either the old
  or the new complete value, never a separate metadata key out of step.
* ``GET`` reads the reply line and the 72-byte header into a small buffer,
  validates the header (magic, format, namespace fingerprint, key, lengths)
  with ``Codec.parse_header`` and only then ``recv_into``s the payload straight
  into the destination buffer (``MSG_WAITALL``: one system call per block), and
  checks the xxh3 checksum before the block is reported filled. A value that
  fails any check is a miss; per the ``RemoteTier`` contract the destination
  of a miss is unspecified. ``stage_reads: true`` instead receives the whole
  value into a per-connection staging buffer and lets ``Codec.decode_into``
  validate it before a single byte is copied to the destination (one more
  memcpy per block). lz4-compressed values always take the staged path.
* Batches are split over ``connections`` sockets per node, each keeping up to
  ``pipeline_bytes`` of requests in flight.

Capacity: the tier relies on the server's ``maxmemory`` and eviction policy and
checks them on every new connection (``CONFIG GET``, falling back to ``INFO
memory``). With ``maxmemory`` 0 (or unknown) the server would grow without
bound, so the tier refuses writes (reads still work; refused puts are counted
as ``put_refused_unbounded``) unless ``allow_unbounded: true``. With a bound but
a policy that does not evict our keys (``noeviction``, or ``volatile-*`` with no
``ttl_s``) it logs a warning once: when the server is full, writes fail with
OOM (counted as ``put_server_oom``) and the cache stops admitting.

Failures never raise on the data path: a refused connection, a reset, a
per-operation timeout (``timeout_s`` without progress, enforced by the kernel
on the socket), garbage, a truncated value or one from another namespace turns
the affected blocks into misses, counted in ``stats()`` as ``<op>_<outcome>``.
Blocks finished before a failure in a batch keep their result, so the longest
valid prefix is still served. A per-node ``CircuitBreaker`` stops a dead node
from being hammered and lets the tier recover by itself when it returns.

Cluster (``cluster: true``): the slot map comes from ``CLUSTER SLOTS`` of any
reachable node; keys are grouped per owning node (CRC16 of the key, with hash
tags honoured) and the groups run concurrently. A ``MOVED``/``ASK`` answer is a
miss that triggers a slot-map refresh; a node that is down costs only its own
slots (run the cluster with ``cluster-require-full-coverage no`` for that).
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import logging
import socket
import ssl
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import xxhash

from tiercache.breaker import CircuitBreaker
from tiercache.codec import FLAG_LZ4, HEADER_SIZE, Codec, DecodeStatus
from tiercache.tiers.base import Capabilities, RemoteContext, RemoteTier
from tiercache.validate import MAX_RETRIES, int_in_range, positive_timeout_s, redis_url, worker_count

logger = logging.getLogger(__name__)

DEFAULT_PORT = 6379
CLUSTER_SLOT_COUNT = 16384
LINE_BUFFER_BYTES = 1024
"""Small reads (reply lines, headers) never pull more than this from the socket,
so at most this many payload bytes are copied instead of received in place."""
SOCKET_BUFFER_BYTES = 4 << 20
"""SO_RCVBUF/SO_SNDBUF: room for a couple of MiB-sized values in flight."""
MIN_KEYS_PER_CONNECTION = 4
"""A batch is only spread over several connections in chunks of at least this many keys."""
CLUSTER_REFRESH_MIN_INTERVAL_S = 1.0
CRLF = b"\r\n"
BYTES = "bytes"
"""Outcome counters carry the payload bytes moved under this name."""
_TOPOLOGY_HINTS = frozenset({"moved", "connect", "connection", "timeout", "unrouted"})
"""Outcomes after which a cluster's slot map may be stale."""
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_MICROSECONDS = 1_000_000
_MILLISECONDS = 1000
_SENDMSG_MAX_BUFFERS = 512
"""Below the kernel's IOV_MAX (1024) per sendmsg call."""


MAX_PIPELINE_BYTES = 1 << 30
"""Most value bytes in flight per socket (``pipeline_bytes``)."""


@dataclass(frozen=True)
class RedisOptions:
    """The ``options`` of a ``type: redis`` tier.

    ``url``: ``redis://[user:password@]host:port[/db]`` (``rediss://`` = TLS); for a
    cluster, any one node. ``key_prefix`` namespaces the Redis keys. ``compress``:
    lz4 per value when it helps. ``ttl_s``: expire entries. ``timeout_s``: a
    socket operation that makes no progress for this long fails (frozen server).
    ``connections``: sockets (and worker threads) per node. ``pipeline_bytes``:
    requests in flight per socket, in value bytes. ``stage_reads``: validate a
    value completely before copying any of it into the destination.
    ``allow_unbounded``: write even when the server has no ``maxmemory``.
    ``breaker_*``: consecutive failures before a node is skipped, first and
    longest back-off.
    """

    url: str = f"redis://127.0.0.1:{DEFAULT_PORT}"
    cluster: bool = False
    key_prefix: str = "tiercache:"
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None
    ssl_verify: bool = True
    compress: bool = False
    ttl_s: float | None = None
    timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    connections: int = 2
    pipeline_bytes: int = 4 << 20
    stage_reads: bool = False
    allow_unbounded: bool = False
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        redis_url("url", self.url)
        worker_count("connections", self.connections)
        int_in_range("pipeline_bytes", self.pipeline_bytes, 1, MAX_PIPELINE_BYTES)
        int_in_range("breaker_failures", self.breaker_failures, 1, MAX_RETRIES)
        for name in ("timeout_s", "connect_timeout_s", "breaker_backoff_s", "breaker_backoff_max_s"):
            positive_timeout_s(name, getattr(self, name))
        parsed = urlparse(self.url)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ValueError(f"url must be redis://host:port or rediss://host:port, got {self.url!r}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive")
        if self.connections < 1 or self.pipeline_bytes < 1 or self.breaker_failures < 1:
            raise ValueError("connections, pipeline_bytes and breaker_failures must be >= 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive (or null for no expiry)")
        if not 0 < self.breaker_backoff_s <= self.breaker_backoff_max_s:
            raise ValueError("need 0 < breaker_backoff_s <= breaker_backoff_max_s")


class _ConnectionFailed(Exception):
    """Inside a worker thread: the connection is unusable; ``kind`` names why."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class _ServerError:
    """A RESP error reply, as a value."""

    message: str

    @property
    def outcome(self) -> str:
        code = self.message.split(" ", 1)[0]
        if code in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"):
            return "moved"
        return "server_oom" if code == "OOM" else "server_error"


def _command(*parts: bytes) -> bytes:
    """Encode one RESP command (array of bulk strings)."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


@dataclass(frozen=True)
class _Capacity:
    """What the server said about its memory bound."""

    maxmemory: int | None
    policy: str | None

    @property
    def bounded(self) -> bool:
        return bool(self.maxmemory)


class _Connection:
    """One blocking socket, used by one worker thread at a time (``abort`` from any thread)."""

    def __init__(self, sock: socket.socket, staging_bytes: int, tls: bool) -> None:
        self.sock = sock
        self._tls = tls
        self._line = bytearray(LINE_BUFFER_BYTES)
        self._line_view = memoryview(self._line)
        self._start = 0
        self._end = 0
        self.staging = memoryview(bytearray(staging_bytes))
        self.capacity = _Capacity(None, None)

    def abort(self) -> None:
        """Make a blocked send/recv in the worker thread fail at once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, buffers: list[bytes | memoryview]) -> None:
        """Send the buffers back to back without joining them."""
        if self._tls:
            for buffer in buffers:
                self.sock.sendall(buffer)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        first = 0
        while first < len(views):
            sent = self.sock.sendmsg(views[first : first + _SENDMSG_MAX_BUFFERS])
            while sent:
                if sent >= len(views[first]):
                    sent -= len(views[first])
                    first += 1
                else:
                    views[first] = views[first][sent:]
                    sent = 0

    def _recv_into(self, view: memoryview, flags: int) -> int:
        count = self.sock.recv_into(view, len(view), 0 if self._tls else flags)
        if count == 0:
            raise _ConnectionFailed("connection", "closed by the server")
        return count

    def _fill(self) -> None:
        """Receive whatever is available (at most the free space of the line buffer)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > 0:
            pending = self._end - self._start
            self._line_view[:pending] = self._line_view[self._start : self._end]
            self._start, self._end = 0, pending
        if self._end == len(self._line):
            raise _ConnectionFailed("protocol", "reply line too long")
        self._end += self._recv_into(self._line_view[self._end :], 0)

    def read_line(self) -> bytes:
        """One reply line without its CRLF."""
        while True:
            index = self._line.find(CRLF, self._start, self._end)
            if index >= 0:
                line = bytes(self._line_view[self._start : index])
                self._start = index + len(CRLF)
                return line
            self._fill()

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: buffered bytes first, then straight from the socket."""
        take = min(len(view), self._end - self._start)
        if take:
            view[:take] = self._line_view[self._start : self._start + take]
            self._start += take
        rest = view[take:]
        while len(rest):
            rest = rest[self._recv_into(rest, _WAITALL) :]

    def skip(self, count: int) -> None:
        """Discard ``count`` bytes (the rest of a value already judged invalid)."""
        while count > 0:
            chunk = min(count, len(self.staging))
            self.read_into(self.staging[:chunk])
            count -= chunk

    def expect_crlf(self) -> None:
        """Consume the CRLF that ends a bulk reply (anything else means the stream is lost).

        Receiving it through the line buffer also picks up the next reply's line and
        header in the same system call.
        """
        while self._end - self._start < len(CRLF):
            self._fill()
        if self._line_view[self._start : self._start + len(CRLF)] != CRLF:
            raise _ConnectionFailed("protocol", "bulk reply not terminated by CRLF")
        self._start += len(CRLF)

    def read_reply(self) -> Any:
        """One RESP2 reply as a value: bytes, int, None, list, or ``_ServerError``."""
        line = self.read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return _ServerError(rest.decode(errors="replace"))
        try:
            number = int(rest)
        except ValueError:
            raise _ConnectionFailed("protocol", f"unexpected reply {line[:40]!r}") from None
        if kind == b":":
            return number
        if kind == b"$":
            if number < 0:
                return None
            value = bytearray(number)
            self.read_into(memoryview(value))
            self.expect_crlf()
            return bytes(value)
        if kind == b"*":
            return None if number < 0 else [self.read_reply() for _ in range(number)]
        raise _ConnectionFailed("protocol", f"unexpected reply {line[:40]!r}")

    def call(self, *parts: bytes) -> Any:
        """One request/reply round trip (set-up and control commands)."""
        self.send([_command(*parts)])
        return self.read_reply()

    def pipeline(
        self,
        count: int,
        depth: int,
        request: Callable[[int], list[bytes | memoryview]],
        handle: Callable[[int], None],
    ) -> None:
        """Send requests ``0..count-1`` keeping up to ``depth`` unanswered; ``handle`` reads reply i."""
        sent = 0

        def push(upto: int) -> None:
            nonlocal sent
            buffers: list[bytes | memoryview] = []
            for index in range(sent, upto):
                buffers.extend(request(index))
            self.send(buffers)
            sent = upto

        push(min(depth, count))
        for index in range(count):
            handle(index)
            if sent < count and sent - (index + 1) <= depth // 2:
                push(min(count, index + 1 + depth))


def _capacity_of(conn: _Connection) -> _Capacity:
    """Ask the server for maxmemory and its policy (CONFIG GET, else INFO memory)."""
    memory = conn.call(b"CONFIG", b"GET", b"maxmemory")
    policy = conn.call(b"CONFIG", b"GET", b"maxmemory-policy")
    if isinstance(memory, list) and len(memory) == 2 and isinstance(policy, list) and len(policy) == 2:
        return _Capacity(int(memory[1]), policy[1].decode())
    info = conn.call(b"INFO", b"memory")
    if not isinstance(info, bytes):
        return _Capacity(None, None)
    fields = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
    maxmemory = fields.get("maxmemory")
    return _Capacity(int(maxmemory) if maxmemory else None, fields.get("maxmemory_policy"))


def _ssl_context(options: RedisOptions) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=options.ssl_ca)
    if options.ssl_cert:
        context.load_cert_chain(options.ssl_cert, options.ssl_key)
    if not options.ssl_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


Job = Callable[[_Connection, Counter], None]
"""Work for one connection, run in its worker thread; it counts outcomes as it goes."""


def _guard(work: Callable[[], None]) -> str | None:
    """Thread side: run ``work``; return the failure kind (None if it succeeded), never raise."""
    try:
        work()
        return None
    except _ConnectionFailed as error:
        return error.kind
    except (TimeoutError, BlockingIOError):
        return "timeout"
    except OSError:
        return "connection"
    except Exception:
        logger.exception("redis tier: unexpected error in a worker thread")
        return "internal"


class _Node:
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
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(options.connections)
        self._executor = ThreadPoolExecutor(options.connections, thread_name_prefix=f"tiercache-{tier.name}")
        self._capacity_logged = False
        self.connects = 0

    def _open(self) -> _Connection:
        """Runs in a worker thread: connect, TLS, AUTH, SELECT, capacity probe."""
        tier, options = self._tier, self._tier.options
        try:
            sock = socket.create_connection((self.host, self.port), timeout=options.connect_timeout_s)
        except OSError as error:
            raise _ConnectionFailed("connect", str(error)) from None
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
                timeval = struct.pack("ll", seconds, int((options.timeout_s - seconds) * _MICROSECONDS))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            conn = _Connection(sock, HEADER_SIZE + tier.block_bytes, tier.tls_context is not None)
            if tier.password is not None:
                credentials = [tier.password.encode()]
                if tier.username:
                    credentials.insert(0, tier.username.encode())
                reply = conn.call(b"AUTH", *credentials)
                if isinstance(reply, _ServerError):
                    raise _ConnectionFailed("auth", reply.message)
            if tier.db:
                reply = conn.call(b"SELECT", str(tier.db).encode())
                if isinstance(reply, _ServerError):
                    raise _ConnectionFailed("auth", reply.message)
            conn.capacity = _capacity_of(conn)
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
            opened: list[_Connection] = []

            def work() -> None:
                if pooled is None:
                    opened.append(self._open())
                job(pooled or opened[0], outcomes)

            future = loop.run_in_executor(self._executor, _guard, work)
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

    def _check_capacity(self, conn: _Connection) -> None:
        if self._capacity_logged:
            return
        self._capacity_logged = True
        capacity, options = conn.capacity, self._tier.options
        if not capacity.bounded and not options.allow_unbounded:
            logger.error(
                "redis tier %s: %s has no maxmemory (or hides it); writes are refused "
                "(set maxmemory with an allkeys-* policy, or allow_unbounded: true)",
                self._tier.name, self.address,
            )
        elif capacity.bounded and not _evicts(capacity.policy, options.ttl_s):
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


def _evicts(policy: str | None, ttl_s: float | None) -> bool:
    if policy is None:
        return False
    return policy.startswith("allkeys-") or (policy.startswith("volatile-") and ttl_s is not None)


def key_slot(key: bytes) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16/XMODEM, ``{hash tags}`` honoured)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % CLUSTER_SLOT_COUNT


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
        self.tls_context = _ssl_context(options) if use_tls else None
        self._prefix = options.key_prefix.encode()
        ttl = options.ttl_s
        ttl_ms = str(int(ttl * _MILLISECONDS)).encode() if ttl else b""
        self._set_tail = CRLF + (b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl_ms), ttl_ms) if ttl else b"")
        self._set_parts = b"*5\r\n" if ttl else b"*3\r\n"
        self._value_bytes = HEADER_SIZE + self.block_bytes
        self._depth = max(1, options.pipeline_bytes // self._value_bytes)
        self._nodes: dict[str, _Node] = {}
        self._slots: list[_Node | None] = []
        self._refresh_task: asyncio.Task | None = None
        self._last_refresh = 0.0
        self._counts: Counter = Counter()

    # -- routing ---------------------------------------------------------

    def _node(self, host: str, port: int) -> _Node:
        address = f"{host}:{port}"
        if address not in self._nodes:
            self._nodes[address] = _Node(host, port, self)
        return self._nodes[address]

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block key (prefix + hex, so no accidental hash tags)."""
        return self._prefix + key.hex().encode()

    def _route(self, keys: Sequence[bytes]) -> tuple[dict[_Node, list[int]], list[int]]:
        """Indices per node, and the indices no node owns (cluster slot uncovered)."""
        if not self.options.cluster:
            return {self._node(*self._seed): list(range(len(keys)))}, []
        groups: dict[_Node, list[int]] = {}
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

    async def _control(self, node: _Node, *parts: bytes) -> Any:
        """One control command on ``node``; its reply, or None when the node failed."""
        reply: list[Any] = []

        def job(conn: _Connection, outcomes: Counter) -> None:
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
            slots: list[_Node | None] = [None] * CLUSTER_SLOT_COUNT
            try:
                for first, last, master, *_replicas in reply:
                    owner = self._node(master[0].decode() or node.host, int(master[1]))
                    slots[first : last + 1] = [owner] * (last - first + 1)
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
        if self.options.cluster and outcomes.keys() & _TOPOLOGY_HINTS:
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
        requests = [_command(b"GET", self.redis_key(keys[i])) for i in chunk]

        def job(conn: _Connection, outcomes: Counter) -> None:
            def handle(j: int) -> None:
                index = chunk[j]
                outcome = self._read_value(conn, keys[index], memoryview(dests[index]).cast("B"))
                results[index] = outcome == "hit"
                outcomes[outcome] += 1
                if outcome == "hit":
                    outcomes[BYTES] += self.block_bytes

            conn.pipeline(len(chunk), self._depth, lambda j: [requests[j]], handle)

        return job

    def _read_value(self, conn: _Connection, key: bytes, dest: memoryview) -> str:
        """Read one GET reply and, if valid, its payload into ``dest``; return the outcome."""
        line = conn.read_line()
        if line[:1] == b"-":
            return _ServerError(line[1:].decode(errors="replace")).outcome
        if line[:1] != b"$":
            raise _ConnectionFailed("protocol", f"unexpected GET reply {line[:40]!r}")
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

        def job(conn: _Connection, outcomes: Counter) -> None:
            if not conn.capacity.bounded and not self.options.allow_unbounded:
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
        requests = [_command(b"EXISTS", self.redis_key(keys[i])) for i in chunk]

        def job(conn: _Connection, outcomes: Counter) -> None:
            def handle(j: int) -> None:
                reply = conn.read_reply()
                results[chunk[j]] = reply == 1
                outcomes["hit" if reply == 1 else getattr(reply, "outcome", "miss")] += 1

            conn.pipeline(len(chunk), len(chunk), lambda j: [requests[j]], handle)

        return job

    def _delete_job(self, chunk: list[int], keys: Sequence[bytes]) -> Job:
        requests = [_command(b"UNLINK", self.redis_key(keys[i])) for i in chunk]

        def job(conn: _Connection, outcomes: Counter) -> None:
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
