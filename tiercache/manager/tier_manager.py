"""TierManager: the engine-facing API (docs/architecture.md, "The contract with the engine") over a ``Stack``.

The facade runs the API calls; the parts live in the stack (``tiercache.manager.stack``):
``MemoryTiers``, ``Hierarchy`` and ``RemoteWrites`` (pure bookkeeping, under one lock), the lookup
(``PrefixLookup``: which tier serves each block), the swap queue, the transfer
lanes and the presence cache, the load runner, the mover (the one completion path) and the
background runtime. Bookkeeping changes in short critical sections; the moves it
asks for are dispatched at the end of each. A remote failure is a miss, never an
exception in the engine's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiercache.blocks.keys import Namespace, token_array
from tiercache.bookkeeping.memory_tiers import LookupPins, PinState
from tiercache.bookkeeping.slots import CapacityError
from tiercache.config import TierCacheConfig, load_config
from tiercache.manager.lookup import Lookup
from tiercache.manager.stack import Stack
from tiercache.movement.transfers import Transfer, TransferKind

__all__ = ["CapacityError", "Lookup", "TierManager", "Transfer"]

LOOKUP_RETRY_SECONDS = 0.0005
"""Pause between lookups while a remote's answer is pending (``lookup_wait``/``lookup_async``)."""
UNPOLLED_TRANSFERS_KEPT = 16_384
"""Finished transfers kept for the next ``poll`` at most: a caller that waits on ``result()`` and never polls
holds this many (a few MB), not every transfer it ever made; past it the oldest go, counted as
``unpolled_transfers_dropped``."""


class TierManager:
    """Stacks the tiers of one topology and moves blocks between them in the background."""

    def __init__(
        self, config: TierCacheConfig | str | os.PathLike[str], *, gpu_tensors: list[torch.Tensor] | None = None
    ) -> None:
        """``config``: a validated topology or a YAML path; ``gpu_tensors``: the engine's own pool, if any."""
        stack = Stack(config if isinstance(config, TierCacheConfig) else load_config(config), gpu_tensors)
        self.parts = stack
        """Every part of the topology (``tiercache.manager.stack``), for tools and tests that look inside."""
        self._books = stack.books
        self.config, self.layout, self.block_size = stack.config, stack.layout, stack.block_size
        self.namespace, self.hasher = stack.namespace, stack.hasher
        self.metrics = stack.metrics
        """Counters and latency histograms (``StatsServer``/Prometheus export the raw histograms from it)."""
        self.gpu = stack.gpu
        """The GPU pool: ``gpu.tensors`` are the paged KV tensors the model's attention reads."""
        self._lock = threading.Lock()
        """Guards the facade's own state: transfers completed since the last poll, best-effort loads."""
        self._completed: deque[Transfer] = deque(maxlen=UNPOLLED_TRANSFERS_KEPT)
        self._best_effort: list[Transfer] = []
        self._started = self._closed = False

    @classmethod
    def from_yaml(cls, path: str, **kwargs: Any) -> TierManager:
        """Build from a YAML topology (see ``tiercache.config``)."""
        return cls(load_config(path), **kwargs)

    # ---- lifecycle -----------------------------------------------------------------------
    def _begin(self) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError("TierManager is closed")
        self.parts.runtime.start()
        self._started = True
        return self.parts.runtime.submit(self.parts.start_remotes(), track=False)

    async def start(self) -> None:
        """Start the background loop and connect the remote tiers."""
        await asyncio.wrap_future(self._begin())

    def start_blocking(self) -> None:
        """``start`` for a synchronous caller."""
        self._begin().result()

    def close_blocking(self) -> None:
        """Settle best-effort loads, finish or drop other work in flight (bounded), close the remotes, stop.

        Afterwards ``poll``, ``stats`` and ``release`` still work; every other call
        raises ``RuntimeError("TierManager is closed")``.
        """
        closing, self._closed = self._started and not self._closed, True
        if closing:
            self._settle_best_effort()
            self.parts.close()

    async def close(self) -> None:
        """``close_blocking`` off the caller's event loop."""
        await asyncio.to_thread(self.close_blocking)

    async def __aenter__(self) -> TierManager:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __enter__(self) -> TierManager:
        self.start_blocking()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_blocking()

    # ---- the engine-facing API -----------------------------------------------------------
    def lookup(
        self, tokens: Sequence[int] | np.ndarray, extra: bytes | str | None = None, *, local_only: bool = False,
        namespace: Namespace | None = None,
    ) -> Lookup:
        """The longest prefix of ``tokens`` cached over all tiers (see ``Lookup``); pins what it counts.

        No other side effect: retry it freely. ``local_only``: GPU and CPU only,
        never pending (remote tiers count as misses). ``namespace``: an engine's own
        (``engine_namespace``: its model's identity), else the topology's ``model.id``;
        ``allocate`` and ``store`` take the same.
        """
        self._require_running()
        keys = self.parts.hasher_of(namespace).keys(tokens, extra)
        found = self._books.find(keys, local_only=local_only)
        if found is None:
            return Lookup(keys, self.block_size, dict.fromkeys(self.parts.names, 0), [], pending=True)
        counts = dict(found.tier_blocks)  # the engine's copy: what the load counts as hits stays as found
        guard = _DropGuard(self._books.abandon, found.pins)
        return Lookup(keys, self.block_size, counts, list(found.pins.gpu_run), tiers=found.tiers, found=found,
                      drop_guard=guard)

    def allocate(
        self, count: int, tokens: Sequence[int] | np.ndarray | None = None, extra: bytes | str | None = None,
        *, namespace: Namespace | None = None,
    ) -> list[int]:
        """``count`` free GPU blocks, held by the caller; evicts (and demotes) by policy.

        With the prompt's ``tokens`` (and ``extra``, as for ``lookup``) the pool's
        policy sees the request's blocks that are not on the GPU before it picks
        victims, as libCacheSim does (exact ARC, S3-FIFO and 2Q decisions); the
        first ids returned are for those blocks, in prompt order. Raises
        ``CapacityError`` and changes nothing when not enough blocks are free or
        evictable; never evicts what an outstanding Lookup pinned.
        """
        self._require_running()
        chain = None if tokens is None else self.parts.hasher_of(namespace).keys(tokens, extra)
        return self._books.allocate(count, chain)

    def store(self, tokens: Sequence[int] | np.ndarray, ids: Sequence[int], extra: bytes | str | None = None,
              *, namespace: Namespace | None = None) -> Transfer:
        """Index the blocks the engine computed into ``ids`` (prompt order) and start their write-down.

        The transfer's result is the tokens indexed; it completes once they are safe
        in the CPU tier (remote writes go on in the background).
        """
        self._require_running()
        array = token_array(tokens)
        keys = self.parts.hasher_of(namespace).keys(array, extra)
        fresh, copies = self._books.store(keys, ids, array)
        stored = min(len(keys), len(ids))
        transfer = Transfer(TransferKind.STORE, stored, self.block_size, [int(block) for block in ids[:stored]])
        work = [c for c in copies if not c.done()]
        self._finish(transfer, fresh * self.block_size, work)
        return transfer

    def load(self, hit: Lookup, ids: Sequence[int], force_latest: bool = False) -> Transfer:
        """Bring the lower-tier part of ``hit`` into the GPU blocks ``ids`` (from ``allocate``).

        Takes over the hit's lower-tier pins. The result is the tokens loaded into
        ``ids``: a prefix of what was asked, possibly shorter (recompute the rest).
        With ``force_latest`` a versioned remote is asked for the newest copy
        instead of trusting the local CPU copy.
        """
        self._require_running()
        found = hit.found
        if hit.pending or found is None or found.pins.state is not PinState.HELD:
            raise ValueError("load: needs a Lookup that is not pending and was neither loaded nor released")
        ids, plan = self._books.plan_load(found, hit.keys, ids, force_latest)
        transfer = Transfer(TransferKind.LOAD, len(plan), self.block_size, list(ids[: len(plan)]))
        if not plan:
            self._finish(transfer, 0, [])
            return transfer
        loads = self.parts.loads
        if loads is not None and loads.resident(plan):  # a local hit: copied from here, no hop to the loop
            loads.run_resident(transfer, plan, lambda blocks: self._complete(transfer, blocks * self.block_size))
            return transfer
        wait_s = self.config.queues.prefetch_wait_s(len(plan) * self.block_size)
        deadline = wait_s if 0 < wait_s < math.inf else None  # a wait of 0 settles at the next poll instead
        running = self.parts.run_load(transfer, plan, force_latest, deadline)
        running.add_done_callback(lambda f: self._complete(transfer, _loaded_tokens(f, self.block_size)))
        if not wait_s:
            with self._lock:
                self._best_effort.append(transfer)
        return transfer

    def release(self, ids_or_hit: Sequence[int] | Lookup) -> None:
        """Hand back GPU blocks (cached ones stay cached), or drop a Lookup that will not be loaded.

        Raises ValueError, releasing nothing, when an id is duplicated, out of range
        or not held by the caller. Works after ``close`` too.
        """
        if isinstance(ids_or_hit, Lookup):
            if ids_or_hit.found is not None:
                self._books.release_lookup(ids_or_hit.found)
            return
        self._books.release_blocks(ids_or_hit)

    def poll(self) -> list[Transfer]:
        """Transfers finished since the last poll (and best-effort loads settled now); the newest
        ``UNPOLLED_TRANSFERS_KEPT`` of them."""
        self._settle_best_effort()
        self._books.reap()
        with self._lock:
            finished = list(self._completed)
            self._completed.clear()
        return finished

    def lookup_wait(self, tokens: Sequence[int] | np.ndarray, extra: bytes | str | None = None,
                    timeout_s: float | None = None, *, namespace: Namespace | None = None) -> Lookup:
        """``lookup`` retried while pending (a synchronous caller); after ``timeout_s``, the local tiers only."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        while (hit := self.lookup(tokens, extra, namespace=namespace)).pending and time.monotonic() < deadline:
            time.sleep(LOOKUP_RETRY_SECONDS)
        return self.lookup(tokens, extra, local_only=True, namespace=namespace) if hit.pending else hit

    async def lookup_async(self, tokens: Sequence[int] | np.ndarray, extra: bytes | str | None = None,
                           timeout_s: float | None = None, *, namespace: Namespace | None = None) -> Lookup:
        """``lookup`` awaited until not pending; after ``timeout_s``, the local tiers only."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        while (hit := self.lookup(tokens, extra, namespace=namespace)).pending and time.monotonic() < deadline:
            await asyncio.sleep(LOOKUP_RETRY_SECONDS)
        return self.lookup(tokens, extra, local_only=True, namespace=namespace) if hit.pending else hit

    def subscribe(self, callback: Any) -> Any:
        """``callback(batch)`` gets every ``KVEventBatch``, off the engine's thread (needs ``events.enabled``)."""
        if self.parts.events is None:
            raise RuntimeError("KV events are off: set events.enabled in the topology")
        return self.parts.events.subscribe(callback)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds``: the cost model's recompute rate."""
        self._require_running()
        self._books.observe_prefill(tokens, seconds)

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy and counters, queue depths and latencies.

        A remote tier's own counters are under ``tiers[name]["store"]``; every
        other per-tier number is the manager's.
        """
        return self.parts.stats()

    # ---- internals -----------------------------------------------------------------------
    def _require_running(self) -> None:
        """Transfers run on the background loop: refuse work before ``start`` or after ``close``."""
        if not self._started or self._closed:
            state = "closed" if self._closed else "not started (call start() or start_blocking() first)"
            raise RuntimeError(f"TierManager is {state}")

    def _settle_best_effort(self) -> None:
        """Best-effort loads end with what has arrived (at a poll, or before the loop stops at close)."""
        with self._lock:
            settle, self._best_effort = self._best_effort, []
        for transfer in settle:
            transfer.cancel()

    def _finish(self, transfer: Transfer, tokens: int, work: list[concurrent.futures.Future[bool]]) -> None:
        """Complete ``transfer`` with ``tokens`` once every future in ``work`` is done."""
        if not work:
            self._complete(transfer, tokens)
            return
        rest = work[1:]
        work[0].add_done_callback(lambda _: self._finish(transfer, tokens, [f for f in rest if not f.done()]))

    def _complete(self, transfer: Transfer, tokens: int) -> None:
        # Under the lock, so a poll() that runs once the transfer is done sees it.
        with self._lock:
            if not transfer.future.done():
                transfer.future.set_result(tokens)
                if len(self._completed) == self._completed.maxlen:
                    self.metrics.add("all", "unpolled_transfers_dropped")
                self._completed.append(transfer)


class _DropGuard:
    """Hands a Lookup's pins to ``abandon`` when the Lookup is dropped (it alone holds the guard): a tenth of a
    ``weakref.finalize``'s cost at each lookup, on the engine's thread."""

    __slots__ = ("_abandon", "_pins")

    def __init__(self, abandon: Callable[[LookupPins], None], pins: LookupPins) -> None:
        self._abandon, self._pins = abandon, pins

    def __del__(self) -> None:
        self._abandon(self._pins)


def _loaded_tokens(future: concurrent.futures.Future[int], block_size: int) -> int:
    if future.cancelled() or future.exception() is not None:
        return 0
    return future.result() * block_size
