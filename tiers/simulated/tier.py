"""A simulated remote store: latency, bandwidth, jitter and injected faults, in process.

It lets the transfer queue, the prefetch policies and the manager be tested
(and benchmarked) against a slow or failing remote without a server. Values are
stored exactly as a real tier stores them, with the ``tiercache.blocks.codec`` header,
so a garbage value really fails header or checksum validation on the way back.
All randomness comes from one seeded ``random.Random``: a run is reproducible.

Clients of one shared store (``SimulatedStore``) share its link of
``bandwidth_mb_s``, served fairly (``tiercache.tiers.simulated.link``). A
bounded store (``capacity_blocks``) drops its oldest entries and every client
tier reports them (``report_evicted``), as a store that tells its evictions does.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import ClassVar

from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.common.units import MS_PER_SECOND
from tiercache.tiers.base import Capabilities, Presence, RemoteContext, RemoteTier, known_checksums
from tiercache.tiers.simulated.options import SimulatedOptions
from tiercache.tiers.simulated.store import SimulatedStore

KEY_BYTES_ON_WIRE = 64
"""Bytes a ``contains`` request costs on the link per key."""
OP_KINDS = ("get", "put", "contains", "delete")


class SimulatedTier(RemoteTier):
    """A ``RemoteTier`` over a ``SimulatedStore``, with latency, bandwidth and fault injection.

    Besides the options, tests may ``hold(kind)`` an operation kind (``get``, ``put``,
    ``contains``, ``delete``): requests of that kind wait (after the first
    ``allow`` of them) until ``unhold(kind)``, which makes orderings deterministic
    without wall-clock sleeps. ``set_down`` switches the store off and on. ``stall(kind, ms)``
    makes the next request of that kind take ``ms`` longer, as a pause of the process would (a
    garbage collection inside a timed read); ``times=None`` slows every one until ``stall(kind, 0)``.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        shared=True, versioned=False, persistent=False, reports_evictions=True, takes_checksums=True
    )
    Options: ClassVar[type] = SimulatedOptions

    def __init__(self, context: RemoteContext, options: SimulatedOptions, *, store: SimulatedStore | None = None):
        super().__init__(context, options)
        if store is None:
            store = SimulatedStore.named(options.store, options) if options.store else SimulatedStore(options)
        self.store = store
        self.client = store.new_client()
        store.watch(self.client, self.report_evicted)
        self._rng = random.Random(options.seed)
        self._started_at = time.monotonic()
        self._down = False
        self._gates: dict[str, asyncio.Event] = {}
        self._allowed: dict[str, int] = {}
        self._stalls: dict[str, tuple[float, int | None]] = {}
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
        self.store.unwatch(self.client)
        for gate in self._gates.values():
            gate.set()
        await super().close()

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

    def stall(self, kind: str, ms: float, times: int | None = 1) -> None:
        """Make the next ``times`` requests of ``kind`` (every one while None) take ``ms`` longer, on top of the
        latency; ``ms`` 0 ends a stall. Set it between requests (it replaces a stall still counting down)."""
        if kind not in OP_KINDS:
            raise ValueError(f"kind must be one of {OP_KINDS}, got {kind!r}")
        if ms < 0 or (times is not None and times < 0):
            raise ValueError(f"ms and times must be >= 0, got {ms!r} and {times!r}")
        if ms and times != 0:
            self._stalls[kind] = (ms, times)
        else:
            self._stalls.pop(kind, None)

    def _stalled_ms(self, kind: str) -> float:
        """The stall this request of ``kind`` takes (counted down)."""
        stall = self._stalls.get(kind)
        if stall is None:
            return 0.0
        ms, times = stall
        if times is not None:
            if times <= 1:
                del self._stalls[kind]
            else:
                self._stalls[kind] = (ms, times - 1)
        return ms

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
        delay = options.latency_ms + self._rng.uniform(0.0, options.jitter_ms) + self._stalled_ms(kind)
        if delay:
            await asyncio.sleep(delay / MS_PER_SECOND)
        if self._is_down():
            self.counters["down_rejections"] += 1
            self.note_error(f"{kind}: the simulated store is down (set_down or down_windows_s)")
            return False
        if options.timeout_rate and self._rng.random() < options.timeout_rate:
            await asyncio.sleep(options.timeout_ms / MS_PER_SECOND)
            self.counters["timeouts"] += 1
            self.note_error(f"{kind}: simulated timeout after {options.timeout_ms:g} ms (timeout_rate)")
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

    def _fails(self, kind: str) -> bool:
        if self.options.error_rate and self._rng.random() < self.options.error_rate:
            self.counters["errors"] += 1
            self.note_error(f"{kind}: simulated error (error_rate)")
            return True
        return False

    # ---- RemoteTier ------------------------------------------------------------------
    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        self._track(1)
        try:
            if not await self._enter("contains", len(keys)):
                return [Presence.UNKNOWN] * len(keys)
            await self._transfer([KEY_BYTES_ON_WIRE] * len(keys))
            data = self.store.data
            return [Presence.UNKNOWN if self._fails("contains") else Presence.of(key in data) for key in keys]
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
                if value is None or self._fails("get"):
                    self.counters["misses"] += 1
                    results.append(False)
                    continue
                garbled = bool(self.options.garbage_rate) and self._rng.random() < self.options.garbage_rate
                if garbled:
                    value = _flip_payload_byte(value)
                decoded = self.codec.decode_into(key, value, dest)
                if not decoded.ok:
                    self.counters["corrupt"] += 1
                    self.counters["misses"] += 1
                    if not garbled:  # the stored value itself failed: judged (and removed if damaged)
                        self.invalid_values.report([((key, value), decoded.status)])
                    results.append(False)
                    continue
                self.counters["hits"] += 1
                self.counters["bytes_read"] += len(dest)
                results.append(True)
            return results
        finally:
            self._track(-1)

    async def put(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        self._track(1)
        try:
            values = [
                self.codec.encode_value(key, payload, checksum=checksum)
                for key, payload, checksum in zip(keys, payloads, known_checksums(checksums, len(keys)), strict=True)
            ]
            if not await self._enter("put", len(keys)):
                return [False] * len(keys)
            await self._transfer([len(value) for value in values])
            results = []
            for key, value in zip(keys, values, strict=True):
                if self._fails("put"):
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

    async def delete_damaged(self, items: list[tuple[bytes, bytes]]) -> int:
        """Remove each damaged (key, value) still stored as read (not a value rewritten since)."""
        data, removed = self.store.data, 0
        for key, value in items:
            if data.get(key) is value:
                del data[key]
                removed += 1
        return removed

    def tier_stats(self) -> dict[str, float]:
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
