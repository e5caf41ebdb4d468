"""TierManager: the engine-facing API (DESIGN's contract), wired from a topology.

The facade only wires the parts and runs the API calls; the parts are
``LocalTiers`` and ``Hierarchy`` (pure bookkeeping, under one lock), the
``SwapQueue`` (GPU<->CPU copies), the transfer queue's lanes and probes (remote
I/O), ``LoadRunner`` (streamed loads) and the ``Runtime`` (the background loop).
Bookkeeping changes in short critical sections, from the engine's thread (the
API calls) or from completions; the moves it asks for are handed to the queues
after each section (``_dispatch``). A remote failure is a miss, never an
exception in the engine's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.codec import Codec
from tiercache.config import PrefetchPolicy, TierCacheConfig, TierConfig, load_config
from tiercache.handles import Lookup, Transfer, TransferKind
from tiercache.hierarchy import FillRule, Hierarchy
from tiercache.keys import BlockHasher, Namespace
from tiercache.loads import FillWaiters, LoadRunner
from tiercache.local_tiers import LocalTiers, LookupPins, PinState, Place, Source
from tiercache.metrics import Metrics
from tiercache.moves import HostCopy, RemotePut
from tiercache.policies import make_policy
from tiercache.queues import prefetch_deadline_s
from tiercache.runtime import Runtime
from tiercache.slots import CapacityError
from tiercache.swap import TorchSwapper
from tiercache.swap_queue import SwapQueue
from tiercache.tiers import tier_class
from tiercache.tiers.base import RemoteContext
from tiercache.tiers.cpu import CpuTier
from tiercache.tiers.gpu import GpuTier
from tiercache.transfer_queue import Lane, RemoteProbes, first_holders

__all__ = ["CapacityError", "Lookup", "TierManager", "Transfer"]

MS_PER_SECOND = 1000.0
CLOSE_DRAIN_SECONDS = 5.0
"""How long ``close`` lets transfers in flight finish before cancelling them."""
CLOSE_REMOTE_SECONDS = 2.0
"""How long each remote tier's own ``close`` may take before it is abandoned."""
REMEMBER_FACTOR = 8
"""Keys remembered (hit counts, written to a remote) per local slot."""
LOOKUP_RETRY_SECONDS = 0.0005
"""Pause between lookups while a remote's answer is pending (``lookup_wait``/``lookup_async``)."""


def _rule(tier: TierConfig) -> FillRule:
    return FillRule(tier.name or tier.type, tier.write_policy, tier.admit_after_hits)


class TierManager:
    """Stacks the tiers of one topology and moves blocks between them in the background."""

    def __init__(
        self, config: TierCacheConfig | str | os.PathLike[str], *, gpu_tensors: list[torch.Tensor] | None = None
    ) -> None:
        """``config``: a validated topology or a YAML path; ``gpu_tensors``: the engine's own pool, if any."""
        if not isinstance(config, TierCacheConfig):
            config = load_config(config)
        self.config, self.layout = config, config.layout
        self.block_size = config.layout.block_size
        model = config.model
        self.namespace = Namespace(model.id, self.layout.fingerprint(), model.tp_rank, model.tenant, model.lora)
        self.hasher = BlockHasher(self.namespace, self.block_size)
        self.metrics = Metrics()
        self._lock = threading.RLock()
        first, *lower = config.tiers
        self.gpu = GpuTier(first.name, self.layout, first.capacity_blocks, self._policy(first), first.options,
                           tensors=gpu_tensors)
        cpu_config = lower.pop(0) if lower and lower[0].type == "cpu" else None
        self.cpu = None if cpu_config is None else CpuTier(
            cpu_config.name, self.layout, cpu_config.capacity_blocks, self._policy(cpu_config), cpu_config.options
        )
        codec = Codec(self.namespace.root())
        self.remotes = [tier_class(t.type)(RemoteContext(t.name, codec, self.layout.bytes_per_block), t.options)
                        for t in lower]
        queues = config.queues
        self._runtime = Runtime()
        lookup_timeout_s = queues.remote_lookup_timeout_ms / MS_PER_SECOND
        self._lanes = [Lane(i, tier, queues.transfer_concurrency, self.metrics, lookup_timeout_s)
                       for i, tier in enumerate(self.remotes)]
        self._probes = RemoteProbes(self._lanes, self._runtime)
        self.local = LocalTiers(self.gpu.table, self.cpu.table if self.cpu else None)
        remember = REMEMBER_FACTOR * (self.gpu.num_blocks + (self.cpu.num_slots if self.cpu else 0))
        self.hierarchy = Hierarchy(
            self.local, _rule(cpu_config) if cpu_config else None, [_rule(t) for t in lower], self.metrics,
            gpu_name=self.gpu.name, max_pending_stores=queues.max_pending_stores, remember_keys=remember,
        )
        self._waiters = FillWaiters()
        self.swap = None if self.cpu is None else SwapQueue(
            TorchSwapper(self.layout, self.gpu.tensors, self.cpu.buffer), self.gpu.tensors, self._runtime
        )
        self._loads = None if self.cpu is None or self.swap is None else LoadRunner(
            self._lock, self.local, self.hierarchy, self.swap, self._lanes, self.cpu.view, self._waiters,
            self.metrics, batch_blocks=queues.batch_blocks, exclusive=config.exclusive, cpu_name=self.cpu.name,
            gpu_name=self.gpu.name, bytes_per_block=self.layout.bytes_per_block,
        )
        self._completed: deque[Transfer] = deque()
        self._best_effort: list[Transfer] = []
        self._abandoned: deque[LookupPins] = deque()
        self._started = self._closed = False

    @staticmethod
    def _policy(tier: TierConfig):
        return make_policy(tier.policy, tier.capacity_blocks, **tier.policy_options)

    @classmethod
    def from_yaml(cls, path: str, **kwargs: Any) -> TierManager:
        """Build from a YAML topology (see ``tiercache.config``)."""
        return cls(load_config(path), **kwargs)

    # ---- lifecycle -----------------------------------------------------------------------
    def _begin(self) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError("TierManager is closed")
        self._runtime.start()
        self._started = True
        return self._runtime.submit(self._start_remotes(), track=False)

    async def _start_remotes(self) -> None:
        await asyncio.gather(*(tier.start() for tier in self.remotes))

    async def start(self) -> None:
        """Start the background loop and connect the remote tiers."""
        await asyncio.wrap_future(self._begin())

    def start_blocking(self) -> None:
        """``start`` for a synchronous caller."""
        self._begin().result()

    def close_blocking(self) -> None:
        """Finish or drop work in flight within ``CLOSE_DRAIN_SECONDS``, close the remotes, stop the loop."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        self._runtime.submit(self._runtime.drain(CLOSE_DRAIN_SECONDS), track=False).result()
        if self.swap is not None:
            self.swap.close()
        self._runtime.submit(self._close_remotes(), track=False).result()
        self._runtime.stop()

    async def _close_remotes(self) -> None:
        await self._runtime.drain(CLOSE_REMOTE_SECONDS)
        closing = [asyncio.ensure_future(tier.close()) for tier in self.remotes]
        if closing:
            await asyncio.wait(closing, timeout=CLOSE_REMOTE_SECONDS)

    async def close(self) -> None:
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
    def lookup(self, tokens: Sequence[int] | np.ndarray, extra: bytes | str | None = None) -> Lookup:
        """The longest prefix of ``tokens`` cached over all tiers (see ``Lookup``); pins what it counts."""
        self._require_running()
        keys = self.hasher.keys(tokens, extra)
        names = [self.gpu.name, *([self.cpu.name] if self.cpu else []), *(t.name for t in self.remotes)]
        with self._lock:
            self._reap_abandoned()
            places = self.local.locate(keys)
            missing = [key for key, place in zip(keys, places, strict=True) if place is None]
            if missing and self._lanes:
                answers = self._probes.answer(missing)
                if answers is None:
                    return Lookup(keys, self.block_size, dict.fromkeys(names, 0), [], pending=True)
                for lane, answer in enumerate(answers):
                    self.hierarchy.forget(lane, [key for key, held in zip(missing, answer, strict=True) if not held])
                remote = iter(first_holders(answers, len(missing)))
                places = [p if p is not None else _remote(next(remote)) for p in places]
            prefix = next((i for i, place in enumerate(places) if place is None), len(places))
            found: list[Place] = places[:prefix]  # type: ignore[assignment]
            run = next((i for i, p in enumerate(found) if p.source is not Source.GPU), len(found))
            counts = dict.fromkeys(names, 0)
            for place in found:
                counts[self._tier_name(place)] += 1
            pins = self.local.hold([p.index for p in found[:run]], found[run:])
            self.metrics.add("all", "lookups")
        hit = Lookup(keys, self.block_size, counts, list(pins.gpu_run))
        hit.pins = pins
        weakref.finalize(hit, self._abandoned.append, pins).atexit = False
        return hit

    def allocate(self, count: int) -> list[int]:
        """``count`` free GPU blocks, held by the caller; evicts (and demotes) by policy.

        Raises ``CapacityError`` and changes nothing when not enough blocks are free
        or evictable; never evicts what an outstanding Lookup pinned.
        """
        with self._lock:
            self._reap_abandoned()
            ids = self.hierarchy.allocate(count)
            self._dispatch()
            return ids

    def store(self, tokens: Sequence[int] | np.ndarray, ids: Sequence[int], extra: bytes | str | None = None
              ) -> Transfer:
        """Index the blocks the engine computed into ``ids`` (prompt order) and start their write-down.

        The transfer's result is the tokens indexed; it completes once they are safe
        in the CPU tier (remote writes go on in the background).
        """
        self._require_running()
        keys = self.hasher.keys(tokens, extra)[: len(ids)]
        ids = list(ids[: len(keys)])
        transfer = Transfer(TransferKind.STORE, len(keys), self.block_size, ids)
        with self._lock:
            for block in ids:
                if self.gpu.table.ref(block) < 1:
                    raise ValueError(f"store: GPU block {block} is not held by the caller")
            fresh = self.hierarchy.store(keys, ids)
            copies = self._dispatch()
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
        pins = hit.pins
        if hit.pending or pins is None or pins.state is not PinState.HELD:
            raise ValueError("load: needs a Lookup that is not pending and was neither loaded nor released")
        queues = self.config.queues
        with self._lock:
            for block in ids:
                if self.gpu.table.ref(block) < 1 or self.gpu.table.key_of(block) is not None:
                    raise ValueError(f"load: GPU block {block} is not a block returned by allocate()")
            pins.state = PinState.LOADED
            self.hierarchy.count_hits(hit.keys[: hit.num_blocks])
            for name, count in hit.tier_blocks.items():
                self.metrics.add(name, "hit_blocks", count)
            self.metrics.add("all", "hit_blocks", hit.num_blocks)
            self.metrics.add("all", "lookup_blocks", len(hit.keys))
            lower_keys = hit.keys[len(pins.gpu_run) : hit.num_blocks]
            plan = self._loads.plan(lower_keys, list(ids), pins.lower, force_latest) if self._loads else []
            self._dispatch()
        transfer = Transfer(TransferKind.LOAD, len(plan), self.block_size, list(ids[: len(plan)]))
        if not plan:
            self._finish(transfer, 0, [])
            return transfer
        deadline = None
        if queues.prefetch is PrefetchPolicy.TIMEOUT:
            deadline = prefetch_deadline_s(
                queues.prefetch_timeout_ms, queues.prefetch_timeout_ms_per_1k_tokens, len(plan) * self.block_size
            )
        assert self._loads is not None
        running = self._runtime.submit(self._loads.run(transfer, plan, force_latest, deadline))
        running.add_done_callback(lambda f: self._complete(transfer, _loaded_tokens(f, self.block_size)))
        if queues.prefetch is PrefetchPolicy.BEST_EFFORT:
            with self._lock:
                self._best_effort.append(transfer)
        return transfer

    def release(self, ids_or_hit: Sequence[int] | Lookup) -> None:
        """Hand back GPU blocks (cached ones stay cached), or drop a Lookup that will not be loaded."""
        with self._lock:
            self._reap_abandoned()
            if isinstance(ids_or_hit, Lookup):
                if ids_or_hit.pins is not None:
                    self.local.drop(ids_or_hit.pins, with_run=True)
                return
            for block in ids_or_hit:
                self.gpu.table.unpin(block)

    def poll(self) -> list[Transfer]:
        """Transfers finished since the last poll (and best-effort loads settled now)."""
        with self._lock:
            self._reap_abandoned()
            settle, self._best_effort = self._best_effort, []
        for transfer in settle:
            transfer.cancel()
        with self._lock:
            finished = list(self._completed)
            self._completed.clear()
        return finished

    def lookup_wait(self, tokens: Sequence[int] | np.ndarray, extra: bytes | str | None = None,
                    timeout_s: float | None = None) -> Lookup:
        """``lookup`` retried while pending (for a synchronous caller); a pending Lookup after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        hit = self.lookup(tokens, extra)
        while hit.pending and (deadline is None or time.monotonic() < deadline):
            time.sleep(LOOKUP_RETRY_SECONDS)
            hit = self.lookup(tokens, extra)
        return hit

    async def lookup_async(self, tokens: Sequence[int] | np.ndarray, extra: bytes | str | None = None,
                           timeout_s: float | None = None) -> Lookup:
        """``lookup`` awaited until not pending (or ``timeout_s`` passes: then the pending Lookup)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        hit = self.lookup(tokens, extra)
        while hit.pending and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(LOOKUP_RETRY_SECONDS)
            hit = self.lookup(tokens, extra)
        return hit

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy and counters, queue depths and latencies.

        A remote tier's own counters are under ``tiers[name]["store"]``; every
        other per-tier number is the manager's.
        """
        with self._lock:
            tiers: dict[str, Any] = {}
            for local in (self.gpu, self.cpu):
                if local is not None:
                    tiers[local.name] = Hierarchy.table_stats(local.table)
            for lane in self._lanes:
                tiers[lane.name] = {"lane_breaker_opened": lane.breaker.opened, "store": _tier_stats(lane)}
            for name, values in self.metrics.snapshot().items():
                tiers.setdefault(name, {}).update(values)
            return {
                "tiers": tiers,
                "queues": {
                    "pending_stores": self.hierarchy.pending_stores,
                    "waiting": {lane.name: lane.limiter.waiting for lane in self._lanes},
                    "active": {lane.name: lane.limiter.active for lane in self._lanes},
                    "in_flight_cpu_writes": len(self._waiters),
                    "in_flight_copies": self.swap.in_flight if self.swap else 0,
                },
            }

    # ---- internals -----------------------------------------------------------------------
    def _require_running(self) -> None:
        """Transfers run on the background loop: refuse work before ``start`` or after ``close``."""
        if not self._started or self._closed:
            state = "closed" if self._closed else "not started (call start() or start_blocking() first)"
            raise RuntimeError(f"TierManager is {state}")

    def _tier_name(self, place: Place) -> str:
        """The tier serving a place of a prefix."""
        if place.source is Source.GPU:
            return self.gpu.name
        if place.source is Source.REMOTE:
            return self.remotes[place.index].name
        assert self.cpu is not None
        return self.cpu.name

    def _reap_abandoned(self) -> None:
        """Drop the lower pins of Lookups the engine let go of without loading or releasing them."""
        while self._abandoned:
            if self.local.drop(self._abandoned.popleft(), with_run=False):
                self.metrics.add("all", "lookups_abandoned")

    def _dispatch(self) -> list[concurrent.futures.Future[bool]]:
        """Hand the hierarchy's moves to the queues (under the lock); returns the copies started."""
        copies = []
        while self.hierarchy.outbox:
            move = self.hierarchy.outbox.pop(0)
            if isinstance(move, HostCopy):
                assert self.swap is not None
                copy = self.swap.to_host(move.gpu_ids, move.cpu_slots, before_reuse=move.before_reuse)
                copy.add_done_callback(lambda done, move=move: self._copy_done(move, done.result()))
                copies.append(copy)
            else:
                self._runtime.submit(self._put(move))
        return copies

    def _copy_done(self, move: HostCopy, ok: bool) -> None:
        with self._lock:
            self.hierarchy.copy_done(move, ok)
            self._waiters.ended(move.keys, [ok] * len(move.keys))
            self._dispatch()

    async def _put(self, move: RemotePut) -> None:
        assert self.cpu is not None
        lane = self._lanes[move.lane]
        oks = await lane.put(move.keys, [self.cpu.view(slot) for slot in move.cpu_slots])
        with self._lock:
            self.hierarchy.put_done(move, oks)
            self.metrics.add(lane.name, "bytes_written", sum(oks) * self.layout.bytes_per_block)

    def _finish(self, transfer: Transfer, tokens: int, work: list[concurrent.futures.Future[bool]]) -> None:
        """Complete ``transfer`` with ``tokens`` once every future in ``work`` is done."""
        remaining = [len(work)]

        def one_done(_: object = None) -> None:
            with self._lock:
                remaining[0] -= 1
                last = remaining[0] <= 0
            if last:
                self._complete(transfer, tokens)

        if not work:
            self._complete(transfer, tokens)
        for future in work:
            future.add_done_callback(one_done)

    def _complete(self, transfer: Transfer, tokens: int) -> None:
        # Under the lock, so a poll() that runs once the transfer is done sees it.
        with self._lock:
            if not transfer.future.done():
                transfer.future.set_result(tokens)
                self._completed.append(transfer)


def _remote(lane: int | None) -> Place | None:
    return None if lane is None else Place(Source.REMOTE, lane)


def _loaded_tokens(future: concurrent.futures.Future[int], block_size: int) -> int:
    if future.cancelled() or future.exception() is not None:
        return 0
    return future.result() * block_size


def _tier_stats(lane: Lane) -> dict[str, Any]:
    try:
        return dict(lane.tier.stats())
    except Exception:
        return {}
