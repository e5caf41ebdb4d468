"""Streamed loads: bring the lower-tier part of a Lookup into the engine's GPU blocks, chunk by chunk.

A load's plan (``tiercache.bookkeeping.load_plan``: one item per block, from the
GPU, the CPU tier, a CPU write in flight or a remote) is run here: remote blocks
are read into their staging CPU slots through the one read path
(``tiercache.movement.reads``), and every change to the bookkeeping is one call
to the ``Bookkeeper``. Chunks of ``batch_blocks`` are fetched
concurrently and handed over in order: as soon as a chunk's leading blocks are
in the CPU tier they are copied into their GPU blocks and indexed there
(``progress_blocks`` grows), so the engine can settle for what has arrived.

The prefetch policies (how long each lets the engine wait:
``QueueConfig.prefetch_wait_s``): ``wait_complete`` runs to the end; ``timeout``
settles at its deadline; ``best_effort`` settles at the engine's next ``poll``. Settling
or ``cancel`` ends the load after the copy in flight, with what has landed; a
fetch still in flight then finishes in the background and its blocks stay
cached in the CPU tier.

A load whose every block is resident already (pinned in the GPU pool or the CPU
tier: a local hit) has nothing to wait for: ``run_resident`` starts its copies
from the caller's thread in one batch, with no hop to the background loop (a
small one on the CPU device is copied there and then, see
``tiercache.movement.swap.queue``), and reports when they land.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence

from tiercache.bookkeeping.load_plan import LoadItem
from tiercache.bookkeeping.memory_tiers import Source
from tiercache.movement.base import Bookkeeper
from tiercache.movement.lanes import Lane
from tiercache.movement.reads import RemoteReader
from tiercache.movement.swap.queue import SwapQueue
from tiercache.movement.transfers import Transfer
from tiercache.telemetry.counters import Metrics
from tiercache.tiers.base import Presence

log = logging.getLogger(__name__)


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
    """Runs planned loads on the background loop: ``run`` into the GPU pool, ``fetch`` into the CPU tier only
    (where the engine copies out of it itself: ``swap`` is None then)."""

    def __init__(
        self, books: Bookkeeper, swap: SwapQueue | None, reader: RemoteReader, views: Callable[[int], memoryview],
        metrics: Metrics, *, batch_blocks: int,
    ) -> None:
        self.books = books
        self.swap = swap
        self.reader = reader
        self.views = views
        self.metrics = metrics
        self.batch_blocks = batch_blocks
        self._checks: set[asyncio.Task[None]] = set()

    async def run(self, transfer: Transfer, plan: list[LoadItem], force_latest: bool, deadline: float | None) -> int:
        """Load ``plan`` into its GPU blocks; returns the blocks loaded (a prefix of the plan)."""
        if self.swap is None:
            raise RuntimeError("a load into a GPU pool tiercache does not manage (fetch into the CPU tier instead)")
        loop = asyncio.get_running_loop()
        settle = asyncio.Event()
        transfer.on_cancel = lambda: _call_soon(loop, settle.set)
        if transfer.settling:
            settle.set()
        timer = loop.call_later(deadline, settle.set) if deadline is not None else None
        chunks = [plan[i : i + self.batch_blocks] for i in range(0, len(plan), self.batch_blocks)]
        fetches = [asyncio.ensure_future(self.fetch(chunk, force_latest)) for chunk in chunks]
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
                    self.books.release(chunk)
                else:
                    fetch.add_done_callback(lambda _f, items=chunk: self.books.release(items))
        if settle.is_set() and loaded < len(plan):
            self.metrics.add("all", "loads_cut_short")
        self.metrics.add("all", "loaded_blocks", loaded)
        return loaded

    @staticmethod
    def resident(plan: Sequence[LoadItem]) -> bool:
        """Every block of ``plan`` is pinned where it lies (GPU pool or CPU tier): nothing to fetch or wait for."""
        return all(item.pinned and not item.staged for item in plan)

    def run_resident(self, transfer: Transfer, plan: list[LoadItem], loaded: Callable[[int], None]) -> None:
        """Copy a ``resident`` plan into its GPU blocks, started from the caller's thread; ``loaded(blocks)`` once
        the copies land (on the caller's thread when they are made at once: ``SwapQueue.copies_now``)."""
        swap = self.swap
        if swap is None:
            raise RuntimeError("a load into a GPU pool tiercache does not manage (fetch into the CPU tier instead)")
        from_cpu = [item for item in plan if not item.on_gpu]
        on_gpu = [item for item in plan if item.on_gpu]
        slots, ids = [item.cpu_slot for item in from_cpu], [_gpu_block(item) for item in from_cpu]
        sources, destinations = [item.place.index for item in on_gpu], [_gpu_block(item) for item in on_gpu]
        if swap.copies_now(len(plan)):
            ok = not from_cpu or swap.to_device_now(slots, ids)
            ok = ok and (not on_gpu or swap.on_device_now(sources, destinations))
            self._resident_landed(transfer, plan, ok, loaded)
            return
        copies = []
        if from_cpu:
            copy, layer_events = swap.to_device(slots, ids)
            copies.append(copy)
            if layer_events is not None:
                transfer.layer_events.append(layer_events)
        if on_gpu:
            copies.append(swap.on_device(sources, destinations))
        landed = _Landing(len(copies), lambda ok: self._resident_landed(transfer, plan, ok, loaded))
        for copy in copies:
            copy.add_done_callback(lambda done: landed.one(done.result()))

    def _resident_landed(
        self, transfer: Transfer, plan: list[LoadItem], ok: bool, loaded: Callable[[int], None]
    ) -> None:
        """Every copy of a resident load ended: index the blocks (or drop the pins of a failed one) and report."""
        if ok:
            self.books.handed_over(plan)
        else:
            self.books.release(plan)
        blocks = len(plan) if ok else 0
        transfer.progress_blocks = blocks
        self.metrics.add("all", "loaded_blocks", blocks)
        loaded(blocks)

    async def fetch(self, items: list[LoadItem], force_latest: bool) -> list[bool]:
        """Get a chunk's bytes into pinned CPU slots (GPU-resident items are ready as they are): per item,
        whether it is ready."""
        staged = [item for item in items if item.staged]
        if staged:
            await self._read(staged, force_latest)
        oks = []
        for item in items:
            if item.place.source is Source.CPU_WRITING and not item.pinned:
                await self._await_fill(item)
            oks.append(item.pinned)
        return oks

    async def _read(self, items: list[LoadItem], force_latest: bool) -> None:
        """Read staged items from the remotes into their slots; commit what arrived, abort the rest.

        A read past its lane's deadline may still write into its blocks' slots: they
        leave the CPU tier's index now and stay reserved until that read ends.
        """
        keys = [item.key for item in items]
        read = await self.reader.read(keys, [self.views(item.cpu_slot) for item in items], force_latest=force_latest)
        self.books.staged_read_ended(items, read)
        for tried in read.tried:
            missed = tried.missed
            self.metrics.add(tried.lane.name, "load_misses", len(missed))
            if missed and tried.read.oks is not None:
                self._check_missing(tried.lane, [keys[i] for i in missed])
        if read.late is not None:
            slots = [items[i].cpu_slot for i in read.unsettled]
            read.late.add_done_callback(lambda _: self.books.late_read_ended(slots))

    def _check_missing(self, lane: Lane, keys: list[bytes]) -> None:
        """Off the load's path: ask whether the keys a read missed are gone, and report those that are.

        A read can miss a block the remote still holds (one failed key, a value
        rewritten meanwhile): only the remote's own "not held" is told to routers.
        """
        check = asyncio.get_running_loop().create_task(self._report_absent(lane, keys))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _report_absent(self, lane: Lane, keys: list[bytes]) -> None:
        clock = self.books.written_clock()
        answers = await lane.contains(keys)
        absent = [key for key, found in zip(keys, answers, strict=True) if found is Presence.ABSENT]
        if absent:
            self.books.found_absent(lane.index, absent, clock)

    async def _await_fill(self, item: LoadItem) -> None:
        """A block another transfer is writing into the CPU tier: share that write."""
        if await asyncio.wrap_future(self.books.wait_for_write(item.key)):
            self.books.fill_landed(item)

    async def _hand_over(self, items: list[LoadItem], transfer: Transfer) -> int:
        """Copy ready items into their GPU blocks and index the promoted ones there."""
        assert self.swap is not None
        from_cpu = [item for item in items if not item.on_gpu]
        on_gpu = [item for item in items if item.on_gpu]
        copies = []
        if from_cpu:
            copy, layer_events = self.swap.to_device(
                [item.cpu_slot for item in from_cpu], [_gpu_block(item) for item in from_cpu]
            )
            copies.append(copy)
            if layer_events is not None:
                transfer.layer_events.append(layer_events)
        if on_gpu:
            copies.append(self.swap.on_device([i.place.index for i in on_gpu], [_gpu_block(i) for i in on_gpu]))
        results = [await asyncio.wrap_future(copy) for copy in copies]
        if not all(results):
            return 0
        self.books.handed_over(items)
        return len(items)


class _Landing:
    """Counts the copies of one load as they end (on any thread); calls ``ended(all landed)`` after the last."""

    def __init__(self, copies: int, ended: Callable[[bool], None]) -> None:
        self._left = copies
        self._ok = True
        self._ended = ended
        self._lock = threading.Lock()

    def one(self, ok: bool) -> None:
        with self._lock:
            self._left -= 1
            self._ok = self._ok and ok
            last = self._left == 0
        if last:
            self._ended(self._ok)


def _gpu_block(item: LoadItem) -> int:
    """The GPU block a manager's load item goes into (every one of a ``TierManager`` load has one)."""
    if item.gpu_id is None:
        raise ValueError("a load into the GPU pool needs a GPU block per item")
    return item.gpu_id


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop`` from any thread; nothing once the loop is closed (the load ended with it)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        if not loop.is_closed():
            raise
