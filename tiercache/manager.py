"""TierManager: the engine-facing API over the GPU pool, the pinned-CPU tier and remote tiers.

State (slot tables, ref counts, in-flight writes) lives behind one lock and is
changed only in short critical sections, from the engine's thread (the API
calls) or from the background I/O loop (completions). Data never moves under
the lock: copies are enqueued on a CUDA side stream or run on a copy thread, and
remote I/O runs as coroutines on the background loop. Nothing here raises into
the engine because a remote failed: a failed block is a miss, and the engine
recomputes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercache.codec import Codec
from tiercache.config import PrefetchPolicy, TierCacheConfig, TierConfig, WritePolicy, load_config
from tiercache.handles import Lookup, Transfer, TransferKind
from tiercache.keys import BlockHasher, Namespace
from tiercache.metrics import Metrics
from tiercache.policies import make_policy
from tiercache.queues import EventLoopThread, Priority, PriorityLimiter, prefetch_deadline_s
from tiercache.slots import CapacityError
from tiercache.swap import CudaEventCopy, SwapHandle, TorchSwapper
from tiercache.tiers import tier_class
from tiercache.tiers.base import RemoteContext, RemoteTier
from tiercache.tiers.cpu import CpuTier
from tiercache.tiers.gpu import GpuTier

__all__ = ["CapacityError", "Lookup", "TierManager", "Transfer"]

log = logging.getLogger(__name__)

EVENT_POLL_SECONDS = 50e-6
"""How often the I/O loop polls a CUDA event of a copy in flight."""
MAX_PENDING_PROBES = 4096
"""Remote lookups remembered between a pending answer and the engine asking again."""
KNOWN_REMOTE_FACTOR = 8
"""Keys remembered as already written to a remote, per local slot (avoids rewrites)."""
MS_PER_SECOND = 1000.0
CLOSE_DRAIN_SECONDS = 5.0
"""How long ``close`` lets transfers in flight finish before cancelling them."""


@dataclass
class _LoadItem:
    """One block of a load: where its bytes come from and which GPU block receives them."""

    key: bytes
    gpu_id: int
    cpu_slot: int | None
    source: str
    fill: concurrent.futures.Future[bool] | None = None
    pinned: bool = False
    consumed: bool = False


class TierManager:
    """Stacks the tiers of one topology and moves blocks between them in the background."""

    def __init__(
        self, config: TierCacheConfig | str | os.PathLike[str], *, gpu_tensors: list[torch.Tensor] | None = None
    ) -> None:
        """``config``: a validated topology, or the path of a YAML one.

        ``gpu_tensors``: the engine's own pool tensors to manage (validated against
        the layout); by default the manager allocates them on the GPU tier's device.
        """
        if not isinstance(config, TierCacheConfig):
            config = load_config(config)
        self.config = config
        self.layout = config.layout
        self.block_size = config.layout.block_size
        model = config.model
        self.namespace = Namespace(model.id, self.layout.fingerprint(), model.tp_rank, model.tenant, model.lora)
        self.hasher = BlockHasher(self.namespace, self.block_size)
        self.metrics = Metrics()
        self._lock = threading.RLock()

        gpu_config = config.tiers[0]
        self.gpu = GpuTier(
            gpu_config.name,
            self.layout,
            gpu_config.capacity_blocks,
            self._policy(gpu_config),
            gpu_config.options,
            tensors=gpu_tensors,
        )
        self.cpu: CpuTier | None = None
        self.cpu_config: TierConfig | None = None
        remote_configs = config.tiers[1:]
        if remote_configs and remote_configs[0].type == "cpu":
            self.cpu_config = remote_configs[0]
            self.cpu = CpuTier(
                self.cpu_config.name,
                self.layout,
                self.cpu_config.capacity_blocks,
                self._policy(self.cpu_config),
                self.cpu_config.options,
            )
            remote_configs = remote_configs[1:]
        codec = Codec(self.namespace.root())
        self.remote_configs = list(remote_configs)
        self.remotes: list[RemoteTier] = [
            tier_class(tc.type)(RemoteContext(tc.name, codec, self.layout.bytes_per_block), tc.options)
            for tc in self.remote_configs
        ]
        self.swapper = TorchSwapper(self.layout, self.gpu.tensors, self.cpu.buffer) if self.cpu else None
        self._on_cuda = self.gpu.device.type == "cuda"

        queues = config.queues
        self._io = EventLoopThread()
        self._limiters = [PriorityLimiter(queues.transfer_concurrency) for _ in self.remotes]
        self._copy_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiercache-copy")
        self._completed: deque[Transfer] = deque()
        self._probes: OrderedDict[tuple[bytes, int], concurrent.futures.Future[list[int]]] = OrderedDict()
        self._fills: dict[bytes, concurrent.futures.Future[bool]] = {}
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        local_slots = self.gpu.num_blocks + (self.cpu.num_slots if self.cpu else 0)
        self._known_limit = KNOWN_REMOTE_FACTOR * local_slots
        self._known_remote: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.remotes]
        self._pending_stores = 0
        self._best_effort: list[Transfer] = []
        self._tasks: set[concurrent.futures.Future[Any]] = set()
        self._started = False
        self._closed = False

    @staticmethod
    def _policy(tier: TierConfig):
        return make_policy(tier.policy, tier.capacity_blocks, **tier.policy_options)

    @classmethod
    def from_yaml(cls, path: str, **kwargs: Any) -> TierManager:
        """Build from a YAML topology (see ``tiercache.config``)."""
        return cls(load_config(path), **kwargs)

    # ---- lifecycle -----------------------------------------------------------------------
    def _begin(self) -> concurrent.futures.Future[None]:
        if self._closed:
            raise RuntimeError("TierManager is closed")
        self._io.start()
        self._started = True
        return self._io.submit(self._start_remotes())

    async def _start_remotes(self) -> None:
        await asyncio.gather(*(tier.start() for tier in self.remotes))

    async def start(self) -> None:
        """Start the background loop and connect the remote tiers."""
        await asyncio.wrap_future(self._begin())

    def start_blocking(self) -> None:
        """``start`` for a synchronous caller."""
        self._begin().result()

    def _shutdown(self) -> concurrent.futures.Future[None] | None:
        if self._closed or not self._started:
            self._closed = True
            return None
        self._closed = True
        return self._io.submit(self._drain_and_close())

    async def _drain_and_close(self) -> None:
        pending = [asyncio.wrap_future(task) for task in list(self._tasks) if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=CLOSE_DRAIN_SECONDS)
        await asyncio.gather(*(tier.close() for tier in self.remotes), return_exceptions=True)

    async def close(self) -> None:
        """Finish or drop work in flight, close the remotes and stop the loop."""
        closing = self._shutdown()
        if closing is not None:
            await asyncio.wrap_future(closing)
            await asyncio.to_thread(self._stop_threads)

    def close_blocking(self) -> None:
        closing = self._shutdown()
        if closing is not None:
            closing.result()
            self._stop_threads()

    def _stop_threads(self) -> None:
        self._io.stop()
        self._copy_thread.shutdown(wait=True)

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
        """The longest cached prefix of ``tokens`` in every tier (see ``Lookup``)."""
        self._require_running()
        keys = self.hasher.keys(tokens, extra)
        with self._lock:
            table = self.gpu.table
            gpu_ids: list[int] = []
            for key in keys:
                slot = table.readable(key)
                if slot is None:
                    break
                gpu_ids.append(slot)
            counts = {self.gpu.name: len(gpu_ids)}
            position = len(gpu_ids)
            if self.cpu is not None:
                in_cpu = 0
                for key in keys[position:]:
                    if key not in self.cpu.table:
                        break
                    in_cpu += 1
                counts[self.cpu.name] = in_cpu
                position += in_cpu
            rest = keys[position:]
            remote_counts = self._probe(rest) if rest and self.remotes else [0] * len(self.remotes)
            pending = remote_counts is None
            for tier, count in zip(self.remotes, remote_counts or [], strict=False):
                counts[tier.name] = count
            if pending:
                return Lookup(keys, self.block_size, counts, gpu_ids, pending=True)
            for slot, key in zip(gpu_ids, keys, strict=False):
                table.pin(slot)
                table.touch(key)
            if self.cpu is not None:
                for key in keys[len(gpu_ids) : len(gpu_ids) + counts[self.cpu.name]]:
                    if self.cpu.table.readable(key) is not None:
                        self.cpu.table.touch(key)
            found = sum(counts.values())
            self._count_hits(keys[:found])
            for name, count in counts.items():
                self.metrics.add(name, "hit_blocks", count)
            self.metrics.add("all", "lookups")
            self.metrics.add("all", "lookup_blocks", len(keys))
            self.metrics.add("all", "hit_blocks", found)
            return Lookup(keys, self.block_size, counts, gpu_ids)

    def allocate(self, count: int) -> list[int]:
        """``count`` free GPU blocks, held by the caller; evicts (and demotes) by policy.

        Raises ``CapacityError`` and changes nothing when not enough blocks are free
        or evictable.
        """
        with self._lock:
            victims: list[tuple[bytes, int]] = []
            ids = self.gpu.table.allocate(count, lambda key, slot: victims.append((key, slot)))
            if victims:
                self.metrics.add(self.gpu.name, "evictions", len(victims))
                self._demote_from_gpu(victims)
            return ids

    def store(
        self, tokens: Sequence[int] | np.ndarray, ids: Sequence[int], extra: bytes | str | None = None
    ) -> Transfer:
        """Index the blocks the engine computed into ``ids`` and start their write-down.

        ``ids`` are the request's GPU blocks in prompt order (a trailing id for a
        partial block is ignored). The transfer's result is the tokens indexed.
        """
        self._require_running()
        keys = self.hasher.keys(tokens, extra)[: len(ids)]
        ids = list(ids[: len(keys)])
        transfer = Transfer(TransferKind.STORE, len(keys), self.block_size, ids)
        with self._lock:
            table = self.gpu.table
            fresh: list[tuple[bytes, int]] = []
            for key, block in zip(keys, ids, strict=True):
                bound = table.key_of(block)
                if bound == key:
                    continue
                if bound is not None:
                    raise ValueError(f"store: GPU block {block} already holds another prefix's KV")
                if key in table:
                    self.metrics.add(self.gpu.name, "duplicate_blocks")
                    continue
                table.bind(block, key)
                fresh.append((key, block))
            self.metrics.add(self.gpu.name, "stored_blocks", len(fresh))
            copy = None
            if fresh and self._cpu_policy() is WritePolicy.WRITE_THROUGH:
                copy = self._copy_to_cpu(fresh)
        self._finish(transfer, copy, len(fresh) * self.block_size)
        return transfer

    def load(self, hit: Lookup, ids: Sequence[int], force_latest: bool = False) -> Transfer:
        """Bring the lower-tier part of ``hit`` into the GPU blocks ``ids`` (from ``allocate``).

        The result is the number of tokens loaded into ``ids``: a prefix of what was
        asked, possibly shorter (a block that failed or arrived late is recomputed).
        With ``force_latest`` a versioned remote is asked for the newest copy instead
        of trusting the local CPU copy.
        """
        self._require_running()
        start = len(hit.gpu_block_ids)
        keys = hit.keys[start : start + min(len(ids), hit.num_lower_blocks)]
        ids = list(ids[: len(keys)])
        transfer = Transfer(TransferKind.LOAD, len(keys), self.block_size, ids)
        bypass_cpu = force_latest and any(t.capabilities.versioned for t in self.remotes)
        with self._lock:
            for block in ids:
                if self.gpu.table.ref(block) < 1 or self.gpu.table.key_of(block) is not None:
                    raise ValueError(f"load: GPU block {block} is not a block returned by allocate()")
            plan = self._plan_load(keys, ids, bypass_cpu) if self.cpu is not None else []
        if not plan:
            self._finish(transfer, None, 0)
            return transfer
        queues = self.config.queues
        deadline = None
        if queues.prefetch is PrefetchPolicy.TIMEOUT:
            deadline = prefetch_deadline_s(
                queues.prefetch_timeout_ms, queues.prefetch_timeout_ms_per_1k_tokens, len(plan) * self.block_size
            )
        task = self._io.submit(self._run_load(transfer, plan, force_latest, deadline))
        self._track(task)
        if queues.prefetch is PrefetchPolicy.BEST_EFFORT:
            with self._lock:
                self._best_effort.append(transfer)
        return transfer

    def release(self, ids: Sequence[int]) -> None:
        """The request no longer needs these GPU blocks; cached ones stay cached."""
        with self._lock:
            for block in ids:
                self.gpu.table.unpin(block)

    def poll(self) -> list[Transfer]:
        """Transfers finished since the last poll (and best-effort loads settled now)."""
        with self._lock:
            settle, self._best_effort = self._best_effort, []
        for transfer in settle:
            transfer.cancel()
        finished = []
        with self._lock:
            while self._completed:
                finished.append(self._completed.popleft())
        return finished

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy and counters, queue depths and latencies."""
        with self._lock:
            tiers: dict[str, Any] = {}
            for local in (self.gpu, self.cpu):
                if local is None:
                    continue
                table = local.table
                tiers[local.name] = {
                    "capacity_blocks": table.num_slots,
                    "cached_blocks": table.num_cached,
                    "free_blocks": table.num_free,
                    "evictable_blocks": table.num_evictable,
                    "evictions": table.evictions,
                }
            for tier in self.remotes:
                try:
                    tiers[tier.name] = dict(tier.stats())
                except Exception:
                    log.exception("stats() of tier %s failed", tier.name)
                    tiers[tier.name] = {}
            counters = self.metrics.snapshot()
            for name, values in counters.items():
                tiers.setdefault(name, {}).update(values)
            return {
                "tiers": tiers,
                "queues": {
                    "pending_stores": self._pending_stores,
                    "waiting": {t.name: lim.waiting for t, lim in zip(self.remotes, self._limiters, strict=True)},
                    "active": {t.name: lim.active for t, lim in zip(self.remotes, self._limiters, strict=True)},
                    "in_flight_cpu_writes": len(self._fills),
                },
            }

    # ---- internals: bookkeeping (caller holds the lock) ----------------------------------
    def _require_running(self) -> None:
        """Transfers run on the background loop: refuse work before ``start`` or after ``close``."""
        if not self._started or self._closed:
            state = "closed" if self._closed else "not started (call start() or start_blocking() first)"
            raise RuntimeError(f"TierManager is {state}")

    def _cpu_policy(self) -> WritePolicy | None:
        return self.cpu_config.write_policy if self.cpu_config else None

    def _probe(self, keys: list[bytes]) -> list[int] | None:
        """Per-remote block counts for ``keys``, or None while the answer is in flight."""
        probe_key = (keys[0], len(keys))
        future = self._probes.get(probe_key)
        if future is None:
            future = self._io.submit(self._probe_remotes(keys))
            self._probes[probe_key] = future
            while len(self._probes) > MAX_PENDING_PROBES:
                self._probes.popitem(last=False)
        if not future.done():
            return None
        del self._probes[probe_key]
        return future.result()

    def _count_hits(self, keys: list[bytes]) -> None:
        """Hit counts feed ``write_through_selective`` admission."""
        for key in keys:
            count = self._hits.pop(key, 0) + 1
            self._hits[key] = count
            self._admit_selective(key, count)
        while len(self._hits) > self._known_limit:
            self._hits.popitem(last=False)

    def _admit_selective(self, key: bytes, count: int) -> None:
        if self.cpu is None:
            return
        cpu_config = self.cpu_config
        assert cpu_config is not None
        if (
            cpu_config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
            and count == cpu_config.admit_after_hits
            and key not in self.cpu.table
        ):
            block = self.gpu.table.readable(key)
            if block is not None:
                self._track(self._copy_to_cpu([(key, block)]))
        slot = self.cpu.table.readable(key)
        if slot is None:
            return
        for index, config in enumerate(self.remote_configs):
            if (
                config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
                and count >= config.admit_after_hits
                and key not in self._known_remote[index]
            ):
                self._track(self._schedule_put(index, [key], [slot]))

    def _begin_cpu_write(self, key: bytes) -> int:
        assert self.cpu is not None
        slot = self.cpu.table.begin_write(key, self._on_cpu_evict)
        self._fills[key] = concurrent.futures.Future()
        return slot

    def _end_cpu_writes(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        assert self.cpu is not None
        for key, slot, ok in zip(keys, slots, oks, strict=True):
            if ok:
                self.cpu.table.commit_write(slot)
            else:
                self.cpu.table.abort_write(slot)
            fill = self._fills.pop(key, None)
            if fill is not None:
                fill.set_result(ok)

    def _on_cpu_evict(self, key: bytes, slot: int) -> None:
        """A CPU victim: write it back to remotes that take write-backs and lack it."""
        assert self.cpu is not None and self.cpu_config is not None
        self.metrics.add(self.cpu.name, "evictions")
        for index, config in enumerate(self.remote_configs):
            if config.write_policy is WritePolicy.WRITE_BACK and key not in self._known_remote[index]:
                if self._pending_stores >= self.config.queues.max_pending_stores:
                    self.metrics.add(self.remotes[index].name, "stores_dropped")
                    continue
                snapshot = bytes(self.cpu.view(slot))
                self._pending_stores += 1
                self._track(self._io.submit(self._put(index, [key], [memoryview(snapshot)], [])))

    def _reserve_cpu_writes(
        self, pairs: list[tuple[bytes, int]], dropped_counter: str
    ) -> tuple[list[bytes], list[int], list[int]]:
        """Begin CPU writes for the (key, GPU block) pairs the CPU tier lacks; count those with no room."""
        assert self.cpu is not None
        keys, blocks, slots = [], [], []
        for key, block in pairs:
            if key in self.cpu.table:
                continue
            try:
                slots.append(self._begin_cpu_write(key))
            except CapacityError:
                self.metrics.add(self.cpu.name, dropped_counter)
                continue
            keys.append(key)
            blocks.append(block)
        return keys, blocks, slots

    def _demote_from_gpu(self, victims: list[tuple[bytes, int]]) -> None:
        """Copy evicted GPU blocks to the CPU tier before the engine reuses them."""
        if self.cpu is None or self.swapper is None:
            return
        keys, blocks, slots = self._reserve_cpu_writes(victims, "demotions_dropped")
        if not keys:
            return
        self.metrics.add(self.cpu.name, "demotions", len(keys))
        self._count_move(self.gpu.name, self.cpu.name, len(keys))
        handle = self.swapper.to_host(blocks, slots)
        if isinstance(handle, CudaEventCopy):
            torch.cuda.current_stream(self.gpu.device).wait_event(handle.event)
            self._track(self._io.submit(self._after_cpu_copy(handle, keys, slots, [])))
        else:
            self._end_cpu_writes(keys, slots, [True] * len(keys))
            self._track(self._write_through(keys))

    def _copy_to_cpu(self, pairs: list[tuple[bytes, int]]) -> concurrent.futures.Future[None] | None:
        """Start GPU->CPU copies of freshly indexed blocks (write-through)."""
        assert self.cpu is not None and self.swapper is not None
        keys, blocks, slots = self._reserve_cpu_writes(pairs, "writes_dropped")
        for block in blocks:
            self.gpu.table.pin(block)
        if not keys:
            return None
        self._count_move(self.gpu.name, self.cpu.name, len(keys))
        if self._on_cuda:
            handle = self.swapper.to_host(blocks, slots)
            return self._io.submit(self._after_cpu_copy(handle, keys, slots, blocks))
        return self._io.submit(self._copy_on_thread(keys, blocks, slots))

    def _write_through(self, keys: Sequence[bytes]) -> concurrent.futures.Future[Any] | None:
        """Schedule puts of freshly committed CPU blocks to write-through remotes."""
        assert self.cpu is not None
        futures = []
        for index, config in enumerate(self.remote_configs):
            if config.write_policy is not WritePolicy.WRITE_THROUGH:
                continue
            todo = [k for k in keys if k not in self._known_remote[index]]
            slots = [self.cpu.table.readable(k) for k in todo]
            pairs = [(k, s) for k, s in zip(todo, slots, strict=True) if s is not None]
            if pairs:
                future = self._schedule_put(index, [k for k, _ in pairs], [s for _, s in pairs])
                if future is not None:
                    futures.append(future)
        if not futures:
            return None
        return self._io.submit(_gather_futures(futures))

    def _schedule_put(self, index: int, keys: list[bytes], slots: list[int]) -> concurrent.futures.Future[None] | None:
        assert self.cpu is not None
        if self._pending_stores + len(keys) > self.config.queues.max_pending_stores:
            self.metrics.add(self.remotes[index].name, "stores_dropped", len(keys))
            return None
        for slot in slots:
            self.cpu.table.pin(slot)
        self._pending_stores += len(keys)
        views = [self.cpu.view(slot) for slot in slots]
        return self._io.submit(self._put(index, keys, views, slots))

    def _plan_load(self, keys: list[bytes], ids: list[int], bypass_cpu: bool) -> list[_LoadItem]:
        assert self.cpu is not None
        table = self.cpu.table
        plan: list[_LoadItem] = []
        for key, block in zip(keys, ids, strict=True):
            if bypass_cpu and key in table and not table.discard(key):
                break
            slot = table.readable(key)
            if slot is not None:
                table.pin(slot)
                plan.append(_LoadItem(key, block, slot, "cpu", pinned=True))
                continue
            if key in table:
                plan.append(_LoadItem(key, block, None, "wait", fill=self._fills[key]))
                continue
            if not self.remotes:
                break
            try:
                slot = self._begin_cpu_write(key)
            except CapacityError:
                self.metrics.add(self.cpu.name, "load_staging_full")
                break
            plan.append(_LoadItem(key, block, slot, "remote"))
        return plan

    def _count_move(self, source: str, destination: str, blocks: int) -> None:
        """Count blocks copied from one tier to another (``blocks_out`` / ``blocks_in``)."""
        self.metrics.add(source, "blocks_out", blocks)
        self.metrics.add(destination, "blocks_in", blocks)

    def _track(self, future: concurrent.futures.Future[Any] | None) -> None:
        if future is None:
            return
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)

    def _finish(self, transfer: Transfer, work: concurrent.futures.Future[Any] | None, tokens: int) -> None:
        """Complete ``transfer`` with ``tokens`` once ``work`` (if any) is done."""

        def complete(_: object = None) -> None:
            # Under the lock, so a poll() that runs once the transfer is done sees it.
            with self._lock:
                if not transfer.future.done():
                    transfer.future.set_result(tokens)
                    self._completed.append(transfer)

        if work is None:
            complete()
        else:
            self._track(work)
            work.add_done_callback(complete)

    # ---- internals: coroutines on the I/O loop -------------------------------------------
    async def _wait_copy(self, handle: SwapHandle) -> None:
        while not handle.done():
            await asyncio.sleep(EVENT_POLL_SECONDS)

    async def _run_copy(self, copy: Callable[[], SwapHandle]) -> None:
        """Run a swap: enqueue on the CUDA side stream and poll, or copy on the copy thread."""
        if self._on_cuda:
            await self._wait_copy(copy())
        else:
            await asyncio.get_running_loop().run_in_executor(self._copy_thread, copy)

    async def _copy_on_thread(self, keys: list[bytes], blocks: list[int], slots: list[int]) -> None:
        assert self.swapper is not None
        ok = True
        try:
            await self._run_copy(lambda: self.swapper.to_host(blocks, slots))
        except Exception:
            log.exception("GPU->CPU copy failed")
            ok = False
        await self._settle_cpu_copy(keys, slots, blocks, ok)

    async def _after_cpu_copy(self, handle: SwapHandle, keys: list[bytes], slots: list[int], blocks: list[int]) -> None:
        await self._wait_copy(handle)
        await self._settle_cpu_copy(keys, slots, blocks, True)

    async def _settle_cpu_copy(self, keys: list[bytes], slots: list[int], blocks: list[int], ok: bool) -> None:
        with self._lock:
            self._end_cpu_writes(keys, slots, [ok] * len(keys))
            for block in blocks:
                self.gpu.table.unpin(block)
            follow = self._write_through(keys) if ok else None
        # Deferred store: the block is safe in the CPU tier, so the store is acknowledged
        # now; the remote writes go on in the background (tracked, drained by close()).
        self._track(follow)

    async def _put(self, index: int, keys: list[bytes], views: list[memoryview], slots: list[int]) -> None:
        tier = self.remotes[index]
        started = time.perf_counter()
        oks = await self._call_tier(
            tier, Priority.STORE, self._limiters[index], lambda: tier.put(keys, views), len(keys)
        )
        self.metrics.observe(tier.name, "put", (time.perf_counter() - started) * MS_PER_SECOND)
        with self._lock:
            assert self.cpu is not None
            for slot in slots:
                self.cpu.table.unpin(slot)
            self._pending_stores -= len(keys)
            known = self._known_remote[index]
            for key, ok in zip(keys, oks, strict=True):
                if ok:
                    known[key] = None
            while len(known) > self._known_limit:
                known.popitem(last=False)
            written = sum(oks)
            self._count_move(self.cpu.name, tier.name, written)
            self.metrics.add(tier.name, "store_failures", len(keys) - written)
            self.metrics.add(tier.name, "bytes_written", written * self.layout.bytes_per_block)

    async def _call_tier(
        self,
        tier: RemoteTier,
        priority: Priority,
        limiter: PriorityLimiter,
        operation: Callable[[], Awaitable[list[bool]]],
        count: int,
    ) -> list[bool]:
        """Run a tier operation inside its limit; any exception is a failure of every key."""
        try:
            result = await limiter.run(priority, operation)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("tier %s raised; counting its keys as failed", tier.name)
            self.metrics.add(tier.name, "exceptions")
            return [False] * count
        if len(result) != count:
            log.error("tier %s returned %d results for %d keys", tier.name, len(result), count)
            return [False] * count
        return [bool(ok) for ok in result]

    async def _probe_remotes(self, keys: list[bytes]) -> list[int]:
        timeout = self.config.queues.remote_lookup_timeout_ms / MS_PER_SECOND

        async def ask(index: int) -> list[bool]:
            tier = self.remotes[index]
            try:
                return await asyncio.wait_for(
                    self._call_tier(tier, Priority.LOAD, self._limiters[index], lambda: tier.contains(keys), len(keys)),
                    timeout,
                )
            except asyncio.TimeoutError:
                self.metrics.add(tier.name, "lookup_timeouts")
                return [False] * len(keys)

        answers = await asyncio.gather(*(ask(i) for i in range(len(self.remotes))))
        counts = [0] * len(self.remotes)
        for position in range(len(keys)):
            holder = next((i for i, answer in enumerate(answers) if answer[position]), None)
            if holder is None:
                break
            counts[holder] += 1
        return counts

    async def _fetch(self, items: list[_LoadItem], force_latest: bool) -> list[bool]:
        """Get a chunk's bytes into pinned CPU slots; pin each slot that arrived."""
        assert self.cpu is not None
        oks = [item.source == "cpu" for item in items]
        remote = [i for i, item in enumerate(items) if item.source == "remote"]
        pending = list(remote)
        arrived: set[int] = set()
        for index, tier in enumerate(self.remotes):
            if not pending:
                break
            keys = [items[i].key for i in pending]
            views = [self.cpu.view(items[i].cpu_slot) for i in pending]
            started = time.perf_counter()
            results = await self._call_tier(
                tier,
                Priority.LOAD,
                self._limiters[index],
                lambda keys=keys, views=views, tier=tier: tier.get_into(keys, views, force_latest=force_latest),
                len(keys),
            )
            self.metrics.observe(tier.name, "get", (time.perf_counter() - started) * MS_PER_SECOND)
            got = [i for i, ok in zip(pending, results, strict=True) if ok]
            arrived.update(got)
            self._count_move(tier.name, self.cpu.name, len(got))
            self.metrics.add(tier.name, "bytes_read", len(got) * self.layout.bytes_per_block)
            self.metrics.add(tier.name, "load_misses", len(pending) - len(got))
            pending = [i for i in pending if i not in arrived]
        with self._lock:
            self._end_cpu_writes(
                [items[i].key for i in remote], [items[i].cpu_slot for i in remote], [i in arrived for i in remote]
            )
            for i in arrived:
                self.cpu.table.pin(items[i].cpu_slot)
                items[i].pinned = True
                oks[i] = True
        for i, item in enumerate(items):
            if item.source == "wait":
                oks[i] = await self._await_fill(item)
        return oks

    async def _await_fill(self, item: _LoadItem) -> bool:
        """A block another transfer is writing into the CPU tier: share that write."""
        assert self.cpu is not None and item.fill is not None
        if not await asyncio.wrap_future(item.fill):
            return False
        with self._lock:
            slot = self.cpu.table.readable(item.key)
            if slot is None:
                return False
            self.cpu.table.pin(slot)
            item.cpu_slot, item.pinned = slot, True
        return True

    async def _run_load(
        self,
        transfer: Transfer,
        plan: list[_LoadItem],
        force_latest: bool,
        deadline: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        settle = asyncio.Event()
        transfer.on_cancel = lambda: self._io.call_soon(settle.set)
        if transfer.settling:
            settle.set()
        timer = loop.call_later(deadline, settle.set) if deadline is not None else None
        batch = self.config.queues.batch_blocks
        chunks = [plan[i : i + batch] for i in range(0, len(plan), batch)]
        fetches = [asyncio.ensure_future(self._fetch(chunk, force_latest)) for chunk in chunks]
        loaded = 0
        try:
            for chunk, fetch in zip(chunks, fetches, strict=True):
                settled = asyncio.ensure_future(settle.wait())
                await asyncio.wait({fetch, settled}, return_when=asyncio.FIRST_COMPLETED)
                settled.cancel()
                if not fetch.done():
                    break
                oks = fetch.result()
                ready = next((i for i, ok in enumerate(oks) if not ok), len(oks))
                if ready:
                    loaded += await self._scatter(chunk[:ready])
                    transfer.progress_blocks = loaded
                if ready < len(chunk) or settle.is_set():
                    break
        except Exception:
            log.exception("load failed; reporting the blocks loaded so far")
        finally:
            if timer is not None:
                timer.cancel()
            for fetch in fetches:
                fetch.add_done_callback(lambda _f, chunk_items=plan: self._unpin_unused(chunk_items))
            self._unpin_unused(plan)
        if settle.is_set() and loaded < len(plan):
            self.metrics.add("all", "loads_cut_short")
        self.metrics.add("all", "loaded_blocks", loaded)
        self._finish(transfer, None, loaded * self.block_size)

    def _unpin_unused(self, items: list[_LoadItem]) -> None:
        with self._lock:
            assert self.cpu is not None
            for item in items:
                if item.pinned and not item.consumed:
                    item.consumed = True
                    item.pinned = False
                    self.cpu.table.unpin(item.cpu_slot)

    async def _scatter(self, items: list[_LoadItem]) -> int:
        """Copy arrived CPU slots into their GPU blocks; index them there (promotion)."""
        assert self.swapper is not None and self.cpu is not None
        slots = [item.cpu_slot for item in items]
        blocks = [item.gpu_id for item in items]
        try:
            await self._run_copy(lambda: self.swapper.to_device(slots, blocks))
        except Exception:
            log.exception("CPU->GPU copy failed")
            return 0
        with self._lock:
            self._count_move(self.cpu.name, self.gpu.name, len(items))
            for item in items:
                item.consumed = True
                item.pinned = False
                self.cpu.table.unpin(item.cpu_slot)
                if item.key not in self.gpu.table:
                    self.gpu.table.bind(item.gpu_id, item.key)
                if self.config.exclusive:
                    self.cpu.table.discard(item.key)
        return len(items)

    # ---- waiting out a pending lookup (hf helper's block; port to the facade as is) ------
    LOOKUP_RETRY_S = 0.001
    """Pause between retries of a pending lookup in ``lookup_wait`` / ``lookup_async``."""

    def _settled(self, hit: Lookup, deadline: float | None) -> Lookup | None:
        """``hit`` once not pending; past ``deadline`` a whole miss (nothing pinned); else None: retry."""
        if not hit.pending:
            return hit
        if deadline is not None and time.monotonic() >= deadline:
            return Lookup(hit.keys, hit.block_size, {tier.name: 0 for tier in self.config.tiers}, [])
        return None

    def lookup_wait(self, tokens: Any, extra: bytes | str | None = None, timeout_s: float | None = None) -> Lookup:
        """``lookup``, retried while pending; past ``timeout_s`` the prompt is a whole miss (recompute it)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (hit := self._settled(self.lookup(tokens, extra), deadline)) is None:
            time.sleep(self.LOOKUP_RETRY_S)
        return hit

    async def lookup_async(
        self, tokens: Any, extra: bytes | str | None = None, timeout_s: float | None = None
    ) -> Lookup:
        """``lookup_wait`` for an asyncio scheduler: sleeps on the loop between retries."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (hit := self._settled(self.lookup(tokens, extra), deadline)) is None:
            await asyncio.sleep(self.LOOKUP_RETRY_S)
        return hit


async def _gather_futures(futures: list[concurrent.futures.Future[Any]]) -> None:
    await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
