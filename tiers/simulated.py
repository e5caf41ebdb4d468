"""A simulated remote store: latency, bandwidth, jitter and injected faults, in process.

It lets the transfer queue, the prefetch policies and the manager be tested
(and benchmarked) against a slow or failing remote without a server. Values are
stored exactly as a real tier stores them, with the ``tiercache.codec`` header,
so a garbage value really fails header or checksum validation on the way back.
All randomness comes from one seeded ``random.Random``: a run is reproducible.

Fairness among clients of one shared store (``SimulatedStore``): the store has
one link of ``bandwidth_mb_s``; a request is cut into sub-batches of at most
``max_batch_blocks`` blocks, and the link serves the clients round-robin, one
sub-batch per turn. A client streaming a huge batch therefore delays another
client's small request by at most one sub-batch per other busy client, instead
of by its whole batch (which is what ``fair: false``, first come first served
with whole requests, does). Round-robin per client was chosen over "just split
huge batches" because splitting alone still queues a small request behind every
sub-batch already enqueued.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tiercache.codec import HEADER_SIZE
from tiercache.tiers.base import Capabilities, RemoteContext, RemoteTier
from tiercache.validate import MAX_TIMEOUT_MS, MAX_TIMEOUT_S, FieldError, number_in_range, queue_size

MS_PER_SECOND = 1000.0
BYTES_PER_MB = 1e6
KEY_BYTES_ON_WIRE = 64
"""Bytes a ``contains`` request costs on the link per key."""
OP_KINDS = ("get", "put", "contains", "delete")


@dataclass
class SimulatedOptions:
    """The YAML ``options`` of a ``simulated`` tier (times in ms, rates in [0, 1])."""

    latency_ms: float = 0.5
    """Round-trip time added to every request."""
    jitter_ms: float = 0.0
    """Uniform extra latency in [0, jitter_ms]."""
    bandwidth_mb_s: float = 0.0
    """Link bandwidth shared by every client of the store; 0 = unlimited."""
    error_rate: float = 0.0
    """Probability that one key of a request fails (a miss or a failed write)."""
    timeout_rate: float = 0.0
    """Probability that a whole request hangs for ``timeout_ms`` and then fails."""
    timeout_ms: float = 100.0
    garbage_rate: float = 0.0
    """Probability that a value read back is corrupted (one payload byte flipped)."""
    down_windows_s: list[list[float]] = field(default_factory=list)
    """``[[start, end], ...]`` seconds after ``start()`` during which every request fails."""
    capacity_blocks: int = 0
    """Entries kept (oldest dropped first); 0 = unbounded."""
    max_batch_blocks: int = 16
    """Sub-batch size on the link (fairness granularity)."""
    fair: bool = True
    """Serve clients round-robin per sub-batch; False = whole requests, first come first served."""
    store: str = ""
    """Tiers naming the same store share its data and link; empty = a private store."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("latency_ms", "jitter_ms", "timeout_ms"):
            number_in_range(name, getattr(self, name), 0.0, MAX_TIMEOUT_MS)
        queue_size("max_batch_blocks", self.max_batch_blocks)
        queue_size("capacity_blocks", self.capacity_blocks, low=0)
        for window in self.down_windows_s:
            if not isinstance(window, list) or len(window) != 2:
                raise FieldError("down_windows_s", "[start, end] pairs of seconds", window)
            for bound in window:
                number_in_range("down_windows_s", bound, 0.0, MAX_TIMEOUT_S)
        for name in ("error_rate", "timeout_rate", "garbage_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        for name in ("latency_ms", "jitter_ms", "bandwidth_mb_s", "timeout_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_batch_blocks < 1:
            raise ValueError(f"max_batch_blocks must be >= 1, got {self.max_batch_blocks}")
        for window in self.down_windows_s:
            if len(window) != 2 or window[0] > window[1]:
                raise ValueError(f"down_windows_s entries must be [start, end], got {window}")


@dataclass(eq=False)
class _Work:
    """One sub-batch waiting for the link."""

    client: int
    nbytes: int
    done: asyncio.Future[None]


class _Link:
    """The store's link on one event loop: serves queued sub-batches one at a time."""

    def __init__(self, bandwidth_mb_s: float, fair: bool) -> None:
        self.bytes_per_second = bandwidth_mb_s * BYTES_PER_MB
        self.fair = fair
        self._queues: dict[int, deque[_Work]] = {}
        self._ring: deque[int] = deque()
        self._fifo: deque[_Work] = deque()
        self._wake = asyncio.Event()
        self._server: asyncio.Task[None] | None = None
        self.served: list[int] = []
        """Client ids in the order their sub-batches crossed the link (for fairness checks)."""

    def submit(self, client: int, sizes: Sequence[int]) -> list[asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        if self._server is None or self._server.done():
            self._server = loop.create_task(self._serve())
        works = [_Work(client, size, loop.create_future()) for size in sizes]
        if self.fair:
            queue = self._queues.setdefault(client, deque())
            if not queue and client not in self._ring:
                self._ring.append(client)
            queue.extend(works)
        else:
            self._fifo.extend(works)
        self._wake.set()
        return [work.done for work in works]

    def _next(self) -> _Work | None:
        if not self.fair:
            return self._fifo.popleft() if self._fifo else None
        while self._ring:
            client = self._ring.popleft()
            queue = self._queues[client]
            if not queue:
                continue
            work = queue.popleft()
            if queue:
                self._ring.append(client)
            return work
        return None

    async def _serve(self) -> None:
        while True:
            work = self._next()
            if work is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if work.done.done():
                continue
            seconds = work.nbytes / self.bytes_per_second if self.bytes_per_second else 0.0
            await asyncio.sleep(seconds)
            self.served.append(work.client)
            if not work.done.done():
                work.done.set_result(None)

    def close(self) -> None:
        if self._server is not None:
            self._server.cancel()


class SimulatedStore:
    """The data and the link of one simulated remote, shared by its client tiers.

    Data is a plain dict touched only from event-loop threads between awaits; the
    link is kept per event loop (each ``TierManager`` runs its own loop).
    """

    _named: ClassVar[dict[str, SimulatedStore]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, options: SimulatedOptions) -> None:
        self.options = options
        self.data: dict[bytes, bytes] = {}
        self._links: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Link] = weakref.WeakKeyDictionary()
        self._clients = 0

    @classmethod
    def named(cls, name: str, options: SimulatedOptions) -> SimulatedStore:
        """The process-wide store called ``name`` (created with ``options`` on first use)."""
        with cls._named_lock:
            store = cls._named.get(name)
            if store is None:
                store = cls._named[name] = cls(options)
            return store

    @classmethod
    def forget(cls, name: str) -> None:
        """Drop a named store (tests start from an empty one)."""
        with cls._named_lock:
            cls._named.pop(name, None)

    def new_client(self) -> int:
        self._clients += 1
        return self._clients

    def link(self) -> _Link:
        loop = asyncio.get_running_loop()
        link = self._links.get(loop)
        if link is None:
            link = self._links[loop] = _Link(self.options.bandwidth_mb_s, self.options.fair)
        return link

    def save(self, key: bytes, value: bytes) -> None:
        self.data.pop(key, None)
        self.data[key] = value
        capacity = self.options.capacity_blocks
        while capacity and len(self.data) > capacity:
            self.data.pop(next(iter(self.data)))

    def close(self) -> None:
        for link in list(self._links.values()):
            link.close()


class SimulatedTier(RemoteTier):
    """A ``RemoteTier`` over a ``SimulatedStore``, with latency, bandwidth and fault injection.

    Besides the options, tests may ``hold(kind)`` an operation kind (``get``, ``put``,
    ``contains``, ``delete``): requests of that kind wait (after the first
    ``allow`` of them) until ``unhold(kind)``, which makes orderings deterministic
    without wall-clock sleeps. ``set_down`` switches the store off and on.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(shared=True, versioned=False, persistent=False)
    Options: ClassVar[type] = SimulatedOptions

    def __init__(self, context: RemoteContext, options: SimulatedOptions, *, store: SimulatedStore | None = None):
        super().__init__(context, options)
        if store is None:
            store = SimulatedStore.named(options.store, options) if options.store else SimulatedStore(options)
        self.store = store
        self.client = store.new_client()
        self._rng = random.Random(options.seed)
        self._started_at = time.monotonic()
        self._down = False
        self._gates: dict[str, asyncio.Event] = {}
        self._allowed: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.calls = dict.fromkeys(OP_KINDS, 0)
        self.keys_requested = dict.fromkeys(OP_KINDS, 0)
        self.in_flight = 0
        self.max_in_flight = 0
        self.started_ops: list[tuple[str, int]] = []
        """(kind, keys) in the order requests entered the tier."""
        self.counters: dict[str, float] = {
            "hits": 0,
            "misses": 0,
            "errors": 0,
            "timeouts": 0,
            "corrupt": 0,
            "down_rejections": 0,
            "bytes_read": 0,
            "bytes_written": 0,
        }

    # ---- lifecycle and test hooks ----------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started_at = time.monotonic()

    async def close(self) -> None:
        for gate in self._gates.values():
            gate.set()

    def set_down(self, down: bool) -> None:
        """Fail every request (as a refused connection would) until called with False."""
        self._down = down

    def hold(self, kind: str, allow: int = 0) -> None:
        """Make requests of ``kind`` wait, after letting ``allow`` more of them through."""
        if kind not in OP_KINDS:
            raise ValueError(f"kind must be one of {OP_KINDS}, got {kind!r}")
        self._allowed[kind] = allow
        self._gates[kind] = asyncio.Event()

    def unhold(self, kind: str) -> None:
        """Let held requests of ``kind`` go on (thread-safe)."""
        gate = self._gates.pop(kind, None)
        self._allowed.pop(kind, None)
        if gate is None:
            return
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(gate.set)
        else:
            gate.set()

    def corrupt(self, key: bytes) -> None:
        """Flip a stored payload byte of ``key`` (its checksum no longer matches)."""
        value = self.store.data.get(key)
        if value is not None and len(value) > HEADER_SIZE:
            self.store.data[key] = _flip_payload_byte(value)

    # ---- the simulation --------------------------------------------------------------
    def _is_down(self) -> bool:
        if self._down:
            return True
        elapsed = time.monotonic() - self._started_at
        return any(start <= elapsed < end for start, end in self.options.down_windows_s)

    async def _enter(self, kind: str, count: int) -> bool:
        """Common prologue: count, hold, latency, faults. False = the whole request fails."""
        self.calls[kind] += 1
        self.keys_requested[kind] += count
        self.started_ops.append((kind, count))
        gate = self._gates.get(kind)
        if gate is not None:
            if self._allowed.get(kind, 0) > 0:
                self._allowed[kind] -= 1
            else:
                await gate.wait()
        options = self.options
        delay = options.latency_ms + self._rng.uniform(0.0, options.jitter_ms)
        if delay:
            await asyncio.sleep(delay / MS_PER_SECOND)
        if self._is_down():
            self.counters["down_rejections"] += 1
            return False
        if options.timeout_rate and self._rng.random() < options.timeout_rate:
            await asyncio.sleep(options.timeout_ms / MS_PER_SECOND)
            self.counters["timeouts"] += 1
            return False
        return True

    async def _transfer(self, sizes: Sequence[int]) -> None:
        """Move ``sizes`` bytes over the shared link in sub-batches."""
        step = self.options.max_batch_blocks
        batches = [sum(sizes[i : i + step]) for i in range(0, len(sizes), step)]
        await asyncio.gather(*self.store.link().submit(self.client, batches))

    def _track(self, delta: int) -> None:
        self.in_flight += delta
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _fails(self) -> bool:
        if self.options.error_rate and self._rng.random() < self.options.error_rate:
            self.counters["errors"] += 1
            return True
        return False

    # ---- RemoteTier ------------------------------------------------------------------
    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._track(1)
        try:
            if not await self._enter("contains", len(keys)):
                return [False] * len(keys)
            await self._transfer([KEY_BYTES_ON_WIRE] * len(keys))
            return [key in self.store.data and not self._fails() for key in keys]
        finally:
            self._track(-1)

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        self._track(1)
        try:
            if not await self._enter("get", len(keys)):
                self.counters["misses"] += len(keys)
                return [False] * len(keys)
            data = self.store.data
            await self._transfer([len(data.get(key, b"")) or KEY_BYTES_ON_WIRE for key in keys])
            results = []
            for key, dest in zip(keys, dests, strict=True):
                value = data.get(key)
                if value is None or self._fails():
                    self.counters["misses"] += 1
                    results.append(False)
                    continue
                if self.options.garbage_rate and self._rng.random() < self.options.garbage_rate:
                    value = _flip_payload_byte(value)
                decoded = self.codec.decode_into(key, value, dest)
                if not decoded.ok:
                    self.counters["corrupt"] += 1
                    self.counters["misses"] += 1
                    results.append(False)
                    continue
                self.counters["hits"] += 1
                self.counters["bytes_read"] += len(value)
                results.append(True)
            return results
        finally:
            self._track(-1)

    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        self._track(1)
        try:
            values = [self.codec.encode_value(key, payload) for key, payload in zip(keys, payloads, strict=True)]
            if not await self._enter("put", len(keys)):
                return [False] * len(keys)
            await self._transfer([len(value) for value in values])
            results = []
            for key, value in zip(keys, values, strict=True):
                if self._fails():
                    results.append(False)
                    continue
                self.store.save(key, value)
                self.counters["bytes_written"] += len(value)
                results.append(True)
            return results
        finally:
            self._track(-1)

    async def delete(self, keys: Sequence[bytes]) -> None:
        if await self._enter("delete", len(keys)):
            for key in keys:
                self.store.data.pop(key, None)

    def stats(self) -> dict[str, float]:
        return {
            **self.counters,
            "entries": len(self.store.data),
            "max_in_flight": self.max_in_flight,
            **{f"{kind}_calls": count for kind, count in self.calls.items()},
        }


def _flip_payload_byte(value: bytes) -> bytes:
    """``value`` with its first payload byte inverted (header intact, checksum now wrong)."""
    if len(value) <= HEADER_SIZE:
        return value[: len(value) // 2]
    corrupted = bytearray(value)
    corrupted[HEADER_SIZE] ^= 0xFF
    return bytes(corrupted)
