"""``FileTier``: the async face of the segment store (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tiercache.tiers.base import Capabilities, Presence, RemoteContext, RemoteTier, known_checksums, outcome_stats
from tiercache.tiers.file.options import FileOptions
from tiercache.tiers.file.segments import ReadResult, SegmentStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
MIN_BYTES_PER_THREAD = 2 << 20
"""A read batch is split over threads only in pieces at least this big (a thread hop costs ~50 µs)."""


class FileTier(RemoteTier):
    """Blocks in append-only segment files under one directory, shared by processes and hosts."""

    capabilities = Capabilities(
        shared=True, versioned=False, persistent=True, reports_evictions=True, takes_checksums=True
    )
    Options = FileOptions

    def __init__(self, context: RemoteContext, options: FileOptions) -> None:
        super().__init__(context, options)
        self.codec = context.codec.variant(compress=options.compress)
        self.root = Path(options.path)
        self._counts: Counter = Counter()
        self.store = SegmentStore(self.root, options, self.codec, self.block_bytes, self._counts, self.note_error)
        self.store.index.on_dropped = self.report_evicted  # segments removed by any writer's clean-up
        self._executor: ThreadPoolExecutor | None = None
        self._gc_task: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Create the root, index what is there, start the periodic GC."""
        self._executor = ThreadPoolExecutor(self.options.threads, thread_name_prefix=f"tiercache-{self.name}")
        try:
            await self._in_thread(self.root.mkdir, parents=True, exist_ok=True)
        except OSError as error:
            logger.warning("file tier %s: cannot create %s: %s", self.name, self.root, error)
            self.note_error(f"start: cannot create {self.root}: {error}")
        await self.gc()
        self._gc_task = asyncio.get_running_loop().create_task(self._periodic_gc())

    async def close(self) -> None:
        """Stop the removals of damaged values and the GC, wait for the I/O threads (off the loop), close."""
        await super().close()
        if self._gc_task is not None:
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task
            self._gc_task = None
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.to_thread(executor.shutdown, wait=True)
        await asyncio.to_thread(self.store.close)

    async def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    # -- data path ---------------------------------------------------------

    async def _refresh_if_missing(self, keys: Sequence[bytes]) -> bool:
        """Pick up other writers' records when this process's index lacks a key; False if that failed."""
        if all(self.store.contains(key) for key in keys):
            return True
        return bool(await self._guarded(self._refresh_index))

    def _refresh_index(self) -> bool:
        self.store.index.refresh()
        return True

    async def _guarded(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn`` in the I/O thread; None (counted, logged) when it raised an OSError."""
        try:
            return await self._in_thread(fn, *args)
        except OSError as error:
            self._counts["io_errors"] += 1
            logger.warning("file tier %s: %s", self.name, error)
            self.note_error(f"{getattr(fn, '__name__', 'io')}: {error}")
            return None

    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        refreshed = await self._refresh_if_missing(keys)
        found = [self.store.contains(key) for key in keys]
        hits = sum(found)
        self._counts["contains_hit"] += hits
        self._counts["contains_miss"] += len(found) - hits
        unheld = Presence.ABSENT if refreshed else Presence.UNKNOWN
        return [Presence.HELD if held else unheld for held in found]

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        if not keys:
            return []
        await self._refresh_if_missing(keys)
        wanted = -(-len(keys) * self.block_bytes // MIN_BYTES_PER_THREAD)
        pieces = max(1, min(self.options.threads, len(keys), wanted))
        bounds = [len(keys) * p // pieces for p in range(pieces + 1)]
        chunks = [range(bounds[p], bounds[p + 1]) for p in range(pieces)]  # contiguous: back-to-back reads
        results = await asyncio.gather(
            *(
                self._guarded(self.store.read_batch, [keys[i] for i in chunk], [dests[i] for i in chunk])
                for chunk in chunks
            )
        )
        outcomes: list[Any] = [ReadResult.IO_ERROR] * len(keys)
        for chunk, chunk_results in zip(chunks, results, strict=True):
            for index, result in zip(chunk, chunk_results or [ReadResult.IO_ERROR] * len(chunk), strict=True):
                outcomes[index] = result
        found = self.store.found_invalid
        self.invalid_values.report(found.popleft() for _ in range(len(found)))
        for outcome in outcomes:
            self._counts[f"get_{outcome.value}"] += 1
        hits = outcomes.count(ReadResult.HIT)
        self._counts["bytes_read"] += hits * self.block_bytes
        return [outcome is ReadResult.HIT for outcome in outcomes]

    async def put(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        if not keys:
            return []
        stored = await self._guarded(self.store.put_batch, keys, payloads, known_checksums(checksums, len(keys)))
        if stored is None:
            self._counts["put_io_error"] += len(keys)
            return [False] * len(keys)
        return stored

    async def delete(self, keys: Sequence[bytes]) -> None:
        known = await self._guarded(self.store.delete, keys)
        self._counts["delete_ok"] += known or 0

    async def delete_damaged(self, items: list[tuple[bytes, int]]) -> int:
        """Tombstone each damaged (key, version): that version goes for every reader, a newer one stays."""

        def tombstone() -> int:
            return sum(self.store.delete([key], version) for key, version in items)

        return await self._guarded(tombstone) or 0

    # -- capacity ------------------------------------------------------------

    async def gc(self) -> None:
        """Re-measure; expire by age; free down to the low watermark when over; refresh the index."""
        await self._guarded(self.store.gc)

    async def _periodic_gc(self) -> None:
        while True:
            await asyncio.sleep(self.options.gc_interval_s)
            await self.gc()

    # -- stats -------------------------------------------------------------

    def tier_stats(self) -> dict[str, float]:
        """``<op>_<outcome>`` counts, hits/misses, bytes, usage, GC counters."""
        out = outcome_stats(self._counts)
        out["used_bytes"] = float(self.store.writer.usage)
        out["used_blocks"] = float(self.store.blocks)
        return out
