"""Streamed loads: bring the lower-tier part of a Lookup into the engine's GPU blocks, chunk by chunk.

A load's plan has one item per block: a GPU-resident block later in the prefix
(copied on the device, never reloaded from below), a CPU slot the Lookup pinned,
a CPU slot still being written by another transfer (waited for), or a remote
block read into a staging CPU slot. Chunks of ``batch_blocks`` are fetched
concurrently and handed over in order: as soon as a chunk's leading blocks are
in the CPU tier they are copied into their GPU blocks and indexed there
(``progress_blocks`` grows), so the engine can settle for what has arrived.

The prefetch policies: ``wait_complete`` runs to the end; ``timeout`` settles
at a deadline; ``best_effort`` settles at the engine's next ``poll``. Settling
or ``cancel`` ends the load after the copy in flight, with what has landed; a
fetch still in flight then finishes in the background and its blocks stay
cached in the CPU tier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.local_tiers import LocalTiers, Place, Source
from tiercache.common.units import MS_PER_SECOND
from tiercache.manager.cost import CostModel
from tiercache.movement.lanes import Lane
from tiercache.movement.swap.queue import SwapQueue
from tiercache.movement.transfers import Transfer
from tiercache.telemetry.counters import Metrics
from tiercache.tiers.base import Presence

log = logging.getLogger(__name__)


@dataclass
class LoadItem:
    """One block of a load: where its bytes come from and the GPU block that receives them."""

    key: bytes
    gpu_id: int
    place: Place
    """GPU: the resident block; CPU: the pinned slot; CPU_WRITING: the slot being written; REMOTE: the lane."""
    slot: int | None = None
    """The CPU slot the bytes pass through (staging for a remote read)."""
    fill: concurrent.futures.Future[bool] | None = None
    pinned: bool = False
    """The item holds a pin on its source (the GPU block or the CPU slot) that it must drop."""


class FillWaiters:
    """Loads waiting for a CPU write another transfer has in flight (thread-safe futures)."""

    def __init__(self) -> None:
        self._waiting: dict[bytes, concurrent.futures.Future[bool]] = {}

    def wait_for(self, key: bytes) -> concurrent.futures.Future[bool]:
        return self._waiting.setdefault(key, concurrent.futures.Future())

    def ended(self, keys: Sequence[bytes], oks: Sequence[bool]) -> None:
        for key, ok in zip(keys, oks, strict=True):
            future = self._waiting.pop(key, None)
            if future is not None:
                future.set_result(ok)

    def __len__(self) -> int:
        return len(self._waiting)


class LoadRunner:
    """Runs planned loads on the background loop (the manager's lock guards all bookkeeping)."""

    def __init__(
        self,
        lock: threading.RLock,
        local: LocalTiers,
        hierarchy: Hierarchy,
        swap: SwapQueue,
        lanes: list[Lane],
        views: Callable[[int], memoryview],
        waiters: FillWaiters,
        metrics: Metrics,
        *,
        batch_blocks: int,
        exclusive: bool,
        cpu_name: str,
        gpu_name: str,
        bytes_per_block: int,
        cost: CostModel | None,
        dispatch: Callable[[], object],
    ) -> None:
        self.lock = lock
        self.local = local
        self.hierarchy = hierarchy
        self.swap = swap
        self.lanes = lanes
        self.views = views
        self.waiters = waiters
        self.metrics = metrics
        self.batch_blocks = batch_blocks
        self.exclusive = exclusive
        self.cpu_name = cpu_name
        self.gpu_name = gpu_name
        self.bytes_per_block = bytes_per_block
        self.cost = cost
        self.dispatch = dispatch
        """Starts the moves the hierarchy asked for (the mover's ``dispatch``; called under the lock)."""
        self._checks: set[asyncio.Task[None]] = set()

    def plan(
        self, keys: Sequence[bytes], ids: Sequence[int], places: Sequence[Place], force_latest: bool
    ) -> list[LoadItem]:
        """Turn a Lookup's lower places (pinned) into load items for ``ids``; call under the lock.

        The plan stops at the first block that cannot be had any more (no staging
        room, a write that failed); the pins of the places it does not use are dropped.
        The CPU tier's policy sees the request for the blocks it serves (tail first).
        """
        plan: list[LoadItem] = []
        for position, place in enumerate(places):
            item = None
            if position < len(ids) and len(plan) == position:
                item = self._item(keys[position], ids[position], place, force_latest)
            if item is None:
                self.local.unpin(place)
            else:
                plan.append(item)
        if self.local.cpu is not None:
            served = [item.key for item in plan if item.place.source is Source.CPU]
            self.local.touch_tail_first(self.local.cpu, served)
            self.hierarchy.observer.accessed(self.cpu_name, served)
        return plan

    def _item(self, key: bytes, gpu_id: int, place: Place, force_latest: bool) -> LoadItem | None:
        cpu = self.local.cpu
        if place.source is Source.GPU:
            return LoadItem(key, gpu_id, place, pinned=True)
        if place.source is Source.CPU:
            if not (force_latest and any(lane.tier.capabilities.versioned for lane in self.lanes)):
                return LoadItem(key, gpu_id, place, slot=place.index, pinned=True)
            self.local.unpin(place)
            if not cpu.discard(key):  # type: ignore[union-attr]
                self.local.pin(place)
                return None
            return self._staged(key, gpu_id)
        assert cpu is not None
        slot = cpu.readable(key)
        if slot is not None:
            cpu.pin(slot)
            return LoadItem(key, gpu_id, Place(Source.CPU, slot), slot=slot, pinned=True)
        if key in cpu:
            writing = Place(Source.CPU_WRITING, cpu.slot_of(key))  # type: ignore[arg-type]
            return LoadItem(key, gpu_id, writing, fill=self.waiters.wait_for(key))
        return self._staged(key, gpu_id) if self.lanes else None

    def _staged(self, key: bytes, gpu_id: int) -> LoadItem | None:
        """A remote read into a fresh CPU slot (None when the CPU tier has no room)."""
        slot = self.hierarchy.begin_cpu_write(key)
        if slot is None:
            self.metrics.add(self.cpu_name, "load_staging_full")
            return None
        return LoadItem(key, gpu_id, Place(Source.REMOTE, 0), slot=slot)

    async def run(self, transfer: Transfer, plan: list[LoadItem], force_latest: bool, deadline: float | None) -> int:
        """Load ``plan`` into its GPU blocks; returns the blocks loaded (a prefix of the plan)."""
        loop = asyncio.get_running_loop()
        settle = asyncio.Event()
        transfer.on_cancel = lambda: _call_soon(loop, settle.set)
        if transfer.settling:
            settle.set()
        timer = loop.call_later(deadline, settle.set) if deadline is not None else None
        chunks = [plan[i : i + self.batch_blocks] for i in range(0, len(plan), self.batch_blocks)]
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
                handed = await self._hand_over(chunk[:ready], transfer) if ready else 0
                loaded += handed
                transfer.progress_blocks = loaded
                if handed < len(chunk) or settle.is_set():
                    break  # the loaded blocks must stay a prefix: nothing after a gap counts
        except Exception:
            log.exception("load failed; reporting the blocks loaded so far")
        finally:
            if timer is not None:
                timer.cancel()
            for fetch, chunk in zip(fetches, chunks, strict=True):
                if fetch.done():
                    self.drop_unused(chunk)
                else:
                    fetch.add_done_callback(lambda _f, items=chunk: self.drop_unused(items))
        if settle.is_set() and loaded < len(plan):
            self.metrics.add("all", "loads_cut_short")
        self.metrics.add("all", "loaded_blocks", loaded)
        return loaded

    def drop_unused(self, items: Sequence[LoadItem]) -> None:
        """Give back the pins of items that were not handed over (their sources stay cached)."""
        with self.lock:
            for item in items:
                if item.pinned:
                    item.pinned = False
                    self._unpin_source(item)

    def _unpin_source(self, item: LoadItem) -> None:
        if item.place.source is Source.GPU:
            self.local.gpu.unpin(item.place.index)
        else:
            assert self.local.cpu is not None and item.slot is not None
            self.local.cpu.unpin(item.slot)

    # ---- fetching into the CPU tier ------------------------------------------------------
    async def _fetch(self, items: list[LoadItem], force_latest: bool) -> list[bool]:
        """Get a chunk's bytes into pinned CPU slots (GPU-resident items are ready as they are)."""
        oks = [item.pinned for item in items]
        remote = [i for i, item in enumerate(items) if item.place.source is Source.REMOTE]
        if remote:
            await self._fetch_remote([items[i] for i in remote], force_latest)
            for i in remote:
                oks[i] = items[i].pinned
        for i, item in enumerate(items):
            if item.place.source is Source.CPU_WRITING:
                oks[i] = await self._await_fill(item)
        return oks

    async def _fetch_remote(self, items: list[LoadItem], force_latest: bool) -> None:
        """Try the lanes in order for each block; commit what arrived, abort the rest.

        A lane that passes its deadline fails its blocks at once, but its read may
        still write into their slots: they leave the CPU tier's index now and stay
        reserved until the read ends (no later lane reads into them either).
        """
        pending = list(items)
        arrived: dict[int, list[LoadItem]] = {}
        late: list[asyncio.Future[Any]] = []
        for lane in self.lanes:
            if not pending or late:
                break
            keys = [item.key for item in pending]
            views = [self.views(item.slot) for item in pending]  # type: ignore[arg-type]
            started = time.perf_counter()
            answer = await lane.read(keys, views, force_latest, on_late=late.append)
            elapsed = time.perf_counter() - started
            results = answer if answer is not None else [False] * len(keys)
            got = [item for item, ok in zip(pending, results, strict=True) if ok]
            missed = [item.key for item, ok in zip(pending, results, strict=True) if not ok]
            arrived[lane.index] = got
            self.metrics.add(lane.name, "blocks_out", len(got))
            self.metrics.add(self.cpu_name, "blocks_in", len(got))
            self.metrics.add(lane.name, "bytes_read", len(got) * self.bytes_per_block)
            self.metrics.add(lane.name, "load_misses", len(missed))
            with self.lock:
                if not late:  # a late lane did not say whether it holds them
                    self.hierarchy.forget(lane.index, missed, proven=False)
                self.hierarchy.observer.accessed(lane.name, keys)
                timed = len(got) or (len(keys) if elapsed >= lane.read_deadline_s else 0)
                if self.cost is not None and timed:
                    # what arrived, or a read that ran to its deadline, times the link; a read that failed
                    # early (open breaker, exception, nothing held) says nothing of it
                    self.cost.observe_fetch(lane.name, timed, timed * self.bytes_per_block, elapsed)
            pending = [item for item, ok in zip(pending, results, strict=True) if not ok]
            if missed and answer is not None:
                self._check_missing(lane, missed)
        held = pending if late else []
        held_ids = {id(item) for item in held}
        landed = {id(item) for group in arrived.values() for item in group}
        with self.lock:
            oks = [id(item) in landed for item in items]
            ending = [(item.slot, ok) for item, ok in zip(items, oks, strict=True) if id(item) not in held_ids]
            self.hierarchy.end_cpu_writes([slot for slot, _ in ending], [ok for _, ok in ending])  # type: ignore[misc]
            for item in held:
                self.local.cpu.abandon_write(item.slot)  # type: ignore[union-attr, arg-type]
            self.waiters.ended([item.key for item in items], oks)
            for item, ok in zip(items, oks, strict=True):
                if ok:
                    self.local.cpu.pin(item.slot)  # type: ignore[union-attr, arg-type]
                    item.pinned = True
            for lane_index, group in arrived.items():
                if group:
                    self.hierarchy.fetched(lane_index, [i.key for i in group], [i.slot for i in group])  # type: ignore[misc]
            self.dispatch()  # promotions into faster remotes start now, not at the engine's next call
        if held:
            slots = [item.slot for item in held]
            late[0].add_done_callback(lambda _: self._free_late(slots))  # type: ignore[arg-type]

    def _check_missing(self, lane: Lane, keys: list[bytes]) -> None:
        """Off the load's path: ask whether the keys a read missed are gone, and report those that are.

        A read can miss a block the remote still holds (one failed key, a value
        rewritten meanwhile): only the remote's own "not held" is told to routers.
        """
        check = asyncio.get_running_loop().create_task(self._report_absent(lane, keys))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _report_absent(self, lane: Lane, keys: list[bytes]) -> None:
        with self.lock:
            clock = self.hierarchy.written_keys.landings
        answers = await lane.contains(keys)
        absent = [key for key, found in zip(keys, answers, strict=True) if found is Presence.ABSENT]
        if absent:
            with self.lock:
                self.hierarchy.forget_absent(lane.index, absent, clock)

    def _free_late(self, slots: list[int]) -> None:
        """A read past its deadline has ended: the slots it could write into are free again."""
        with self.lock:
            for slot in slots:
                self.local.cpu.unpin(slot)  # type: ignore[union-attr]

    async def _await_fill(self, item: LoadItem) -> bool:
        """A block another transfer is writing into the CPU tier: share that write."""
        assert item.fill is not None
        if not await asyncio.wrap_future(item.fill):
            return False
        with self.lock:
            cpu = self.local.cpu
            assert cpu is not None
            slot = cpu.readable(item.key)
            if slot is None:
                return False
            cpu.pin(slot)
            item.slot, item.pinned = slot, True
        return True

    # ---- handing blocks over to the GPU -----------------------------------------------------
    async def _hand_over(self, items: list[LoadItem], transfer: Transfer) -> int:
        """Copy ready items into their GPU blocks and index the promoted ones there."""
        from_cpu = [item for item in items if item.place.source is not Source.GPU]
        on_gpu = [item for item in items if item.place.source is Source.GPU]
        copies = []
        if from_cpu:
            copy, layer_events = self.swap.to_device([i.slot for i in from_cpu], [i.gpu_id for i in from_cpu])  # type: ignore[misc]
            copies.append(copy)
            if layer_events is not None:
                transfer.layer_events.append(layer_events)
        if on_gpu:
            copies.append(self.swap.on_device([i.place.index for i in on_gpu], [i.gpu_id for i in on_gpu]))
        results = [await asyncio.wrap_future(copy) for copy in copies]
        if not all(results):
            return 0
        gpu, cpu = self.local.gpu, self.local.cpu
        with self.lock:
            self.metrics.add(self.cpu_name, "blocks_out", len(from_cpu))
            self.metrics.add(self.gpu_name, "blocks_in", len(items))
            promoted, freed = [], []
            for item in items:
                item.pinned = False
                self._unpin_source(item)
                if item.place.source is Source.GPU:
                    continue
                assert cpu is not None
                if item.key not in gpu:
                    gpu.bind(item.gpu_id, item.key, track=False)
                    promoted.append(item.key)
                if self.exclusive and cpu.discard(item.key):
                    freed.append(item.key)
            self.hierarchy.observer.stored(self.gpu_name, promoted, None, None)
            self.hierarchy.observer.removed(self.cpu_name, freed)
        return len(items)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop`` from any thread; nothing once the loop is closed (the load ended with it)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        if not loop.is_closed():
            raise


TOKENS_PER_K = 1000.0


def prefetch_deadline_s(timeout_ms: float, timeout_ms_per_1k_tokens: float, tokens: int) -> float:
    """The ``timeout`` prefetch policy's deadline: a base plus a share that grows with the tokens."""
    return (timeout_ms + timeout_ms_per_1k_tokens * tokens / TOKENS_PER_K) / MS_PER_SECOND
