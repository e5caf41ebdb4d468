"""Blocks as files on a local disk or a mounted distributed file system.

One file per block at ``<path>/<k0k1>/<k2k3>/<key hex>.kv`` (two levels of
hashed directories keep directories small), holding the ``tiercache.codec``
header and payload. A write goes to a unique temporary file in the same
directory and is renamed over the final name, so a reader sees either no file,
the old value or the new value, never a partial one, and concurrent writers of
one key (other threads, processes or hosts on a shared mount) cannot corrupt
it: the last rename wins. A read validates header and checksum
(``Codec.decode_into``) before anything reaches the destination. All file I/O
runs in a thread pool, never on the event loop.

Capacity: ``max_bytes`` and/or ``max_blocks`` (one is required: the tier never
grows without bound). The tier keeps an estimate of its usage (from the last
scan plus its own writes); a write that would go over runs a GC pass first,
which removes the least recently used files (by mtime; reads touch it unless
``touch_on_read: false``) down to ``gc_low_watermark`` of the capacity, and
fails the write (``put_full``) if that is not enough. ``max_age_s`` expires
files not used for that long; a periodic pass (``gc_interval_s``) applies it,
re-measures the directory (other processes may share it) and removes temporary
files left behind by crashed writers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tiercache.codec import HEADER_SIZE, Codec, DecodeStatus
from tiercache.config import parse_size
from tiercache.tiers.base import Capabilities, RemoteContext, RemoteTier
from tiercache.validate import (
    FieldError,
    fraction,
    int_in_range,
    non_empty_string,
    number_in_range,
    positive_timeout_s,
    worker_count,
)

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
STALE_TEMP_AGE_S = 600.0
"""A temporary file older than this belongs to a writer that died; GC removes it."""
DIR_LEVELS = 2
HEX_PER_LEVEL = 2
T = TypeVar("T")
MAX_FILE_TIER_BYTES = 1 << 60
"""Largest ``max_bytes`` (and ``max_blocks``) accepted: an exabyte; more is a unit mistake."""
MAX_AGE_S = 10 * 365 * 24 * 3600.0
"""Longest ``max_age_s``: ten years."""


@dataclass(frozen=True)
class FileOptions:
    """The ``options`` of a ``type: file`` tier.

    ``path``: the root directory (created if missing). ``max_bytes`` (``"20GiB"``
    or an integer) and/or ``max_blocks``: capacity, one required. ``max_age_s``:
    expire blocks unused for that long. ``gc_interval_s``: period of the
    background pass. ``gc_low_watermark``: a capacity GC frees down to this
    fraction. ``touch_on_read``: reads refresh the file's mtime (LRU order).
    ``fsync``: make each write durable before it is acknowledged. ``compress``:
    lz4. ``threads``: parallel file operations.
    """

    path: str
    max_bytes: int | str | None = None
    max_blocks: int | None = None
    max_age_s: float | None = None
    gc_interval_s: float = 30.0
    gc_low_watermark: float = 0.9
    touch_on_read: bool = True
    fsync: bool = False
    compress: bool = False
    threads: int = 4

    def __post_init__(self) -> None:
        non_empty_string("path", self.path)
        if self.max_bytes is None and self.max_blocks is None:
            raise FieldError("max_bytes", "max_bytes and/or max_blocks: a file tier must be bounded")
        if self.max_bytes is not None:
            try:
                size = parse_size(self.max_bytes)
            except (ValueError, OverflowError):
                raise FieldError("max_bytes", "a size such as 20GiB or an integer", self.max_bytes) from None
            object.__setattr__(self, "max_bytes", int_in_range("max_bytes", size, 1, MAX_FILE_TIER_BYTES))
        if self.max_blocks is not None:
            int_in_range("max_blocks", self.max_blocks, 1, MAX_FILE_TIER_BYTES)
        if self.max_age_s is not None:
            number_in_range("max_age_s", self.max_age_s, 0.0, MAX_AGE_S, low_open=True)
        positive_timeout_s("gc_interval_s", self.gc_interval_s)
        fraction("gc_low_watermark", self.gc_low_watermark, low_open=True)
        worker_count("threads", self.threads)


@dataclass
class _Usage:
    """What a GC pass found and did."""

    bytes: int = 0
    blocks: int = 0
    removed_blocks: int = 0
    removed_bytes: int = 0
    expired: int = 0
    stale_temps: int = 0


class FileTier(RemoteTier):
    """A directory of block files (see the module docstring)."""

    capabilities = Capabilities(shared=True, versioned=False, persistent=True)
    Options = FileOptions

    def __init__(self, context: RemoteContext, options: FileOptions) -> None:
        super().__init__(context, options)
        self.codec = Codec(context.codec.fingerprint, compress=options.compress)
        self.root = Path(options.path)
        self._file_bytes = HEADER_SIZE + self.block_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._counts: Counter = Counter()
        self._used_bytes = 0
        self._used_blocks = 0
        self._gc_lock = asyncio.Lock()
        self._gc_task: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Create the root, measure what is there, start the periodic GC."""
        self._executor = ThreadPoolExecutor(self.options.threads, thread_name_prefix=f"tiercache-{self.name}")
        try:
            await self._in_thread(self.root.mkdir, parents=True, exist_ok=True)
        except OSError as error:
            logger.warning("file tier %s: cannot create %s: %s", self.name, self.root, error)
        await self.gc()
        self._gc_task = asyncio.get_running_loop().create_task(self._periodic_gc())

    async def close(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task
            self._gc_task = None
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.to_thread(executor.shutdown, wait=True)

    async def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def _map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``fn`` over ``items`` in up to ``threads`` parallel chunks; results in order."""
        pieces = max(1, min(self.options.threads, len(items)))
        chunks = [list(range(p, len(items), pieces)) for p in range(pieces)]
        results: list[Any] = [None] * len(items)

        def run(indices: list[int]) -> None:
            for index in indices:
                results[index] = fn(items[index])

        await asyncio.gather(*(self._in_thread(run, chunk) for chunk in chunks))
        return results

    # -- paths -----------------------------------------------------------

    def path_of(self, key: bytes) -> Path:
        """Where the block ``key`` lives."""
        name = key.hex()
        parts = [name[i * HEX_PER_LEVEL : (i + 1) * HEX_PER_LEVEL] for i in range(DIR_LEVELS)]
        return self.root.joinpath(*parts, name + SUFFIX)

    # -- data path ---------------------------------------------------------

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        found = await self._map(lambda key: self.path_of(key).is_file(), list(keys))
        hits = sum(found)
        self._counts["contains_hit"] += hits
        self._counts["contains_miss"] += len(found) - hits
        return found

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        outcomes = await self._map(lambda pair: self._read(*pair), list(zip(keys, dests, strict=True)))
        for outcome in outcomes:
            self._counts[f"get_{outcome}"] += 1
        hits = outcomes.count("hit")
        self._counts["bytes_read"] += hits * self.block_bytes
        return [outcome == "hit" for outcome in outcomes]

    def _staging(self) -> memoryview:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = memoryview(bytearray(self._file_bytes))
        return staging

    def _read(self, key: bytes, dest: memoryview) -> str:
        """Thread side: read, validate, copy; return the outcome."""
        path = self.path_of(key)
        try:
            with open(path, "rb", buffering=0) as handle:
                size = os.fstat(handle.fileno()).st_size
                if size > self._file_bytes:
                    return DecodeStatus.BAD_LENGTH.value
                staging = self._staging()[:size]
                filled = 0
                while filled < size:
                    count = handle.readinto(staging[filled:])
                    if not count:
                        break
                    filled += count
            if self.options.touch_on_read:
                with contextlib.suppress(OSError):
                    os.utime(path)
        except FileNotFoundError:
            return "miss"
        except OSError:
            return "io_error"
        status = self.codec.decode_into(key, staging[:filled], memoryview(dest).cast("B")).status
        return "hit" if status is DecodeStatus.OK else status.value

    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        if not keys:
            return []
        incoming = len(keys) * self._file_bytes
        if self._over_capacity(incoming):
            await self.gc(incoming)
        if self._over_capacity(incoming):
            self._counts["put_full"] += len(keys)
            return [False] * len(keys)
        sizes = await self._map(lambda pair: self._write(*pair), list(zip(keys, payloads, strict=True)))
        written = [size for size in sizes if size is not None]
        self._used_bytes += sum(written)
        self._used_blocks += len(written)
        self._counts["bytes_written"] += sum(written)
        self._counts["put_ok"] += len(written)
        self._counts["put_io_error"] += len(sizes) - len(written)
        return [size is not None for size in sizes]

    def _write(self, key: bytes, payload: memoryview) -> int | None:
        """Thread side: write a temporary file, then rename it into place; bytes or None."""
        header, stored = self.codec.encode(key, payload)
        path = self.path_of(key)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                views = [memoryview(header), memoryview(stored).cast("B")]
                while views:
                    count = os.writev(fd, views)
                    while views and count >= len(views[0]):
                        count -= len(views[0])
                        views.pop(0)
                    if views:
                        views[0] = views[0][count:]
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
            return len(header) + len(stored)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return None

    async def delete(self, keys: Sequence[bytes]) -> None:
        def remove(key: bytes) -> int:
            path = self.path_of(key)
            try:
                size = path.stat().st_size
                path.unlink()
                return size
            except OSError:
                return -1

        sizes = [size for size in await self._map(remove, list(keys)) if size >= 0]
        self._used_bytes = max(0, self._used_bytes - sum(sizes))
        self._used_blocks = max(0, self._used_blocks - len(sizes))
        self._counts["delete_ok"] += len(sizes)

    # -- capacity ------------------------------------------------------------

    def _over_capacity(self, incoming: int) -> bool:
        return self._exceeds(self._used_bytes, self._used_blocks, incoming)

    def _exceeds(self, used_bytes: int, used_blocks: int, incoming: int) -> bool:
        """Whether ``incoming`` more bytes (whole blocks) would go over a capacity bound."""
        blocks = len(range(0, incoming, self._file_bytes))
        max_bytes, max_blocks = self.options.max_bytes, self.options.max_blocks
        return (max_bytes is not None and used_bytes + incoming > max_bytes) or (
            max_blocks is not None and used_blocks + blocks > max_blocks
        )

    async def gc(self, incoming: int = 0) -> None:
        """Re-measure; expire by age; free down to the low watermark when over capacity."""
        async with self._gc_lock:
            try:
                usage = await self._in_thread(self._gc_pass, incoming)
            except OSError as error:
                self._counts["gc_errors"] += 1
                logger.warning("file tier %s: GC failed: %s", self.name, error)
                return
        self._used_bytes, self._used_blocks = usage.bytes, usage.blocks
        self._counts["gc_runs"] += 1
        self._counts["gc_removed_blocks"] += usage.removed_blocks
        self._counts["gc_removed_bytes"] += usage.removed_bytes
        self._counts["gc_expired"] += usage.expired
        self._counts["gc_stale_temps"] += usage.stale_temps

    async def _periodic_gc(self) -> None:
        while True:
            await asyncio.sleep(self.options.gc_interval_s)
            await self.gc()

    def _gc_pass(self, incoming: int) -> _Usage:
        """Thread side: one scan of the tree and the removals it calls for."""
        now = time.time()
        usage = _Usage()
        files: list[tuple[float, int, str]] = []
        if not self.root.is_dir():
            return usage
        max_age = self.options.max_age_s
        for first in os.scandir(self.root):
            if not first.is_dir():
                continue
            for second in os.scandir(first.path):
                if not second.is_dir():
                    continue
                for entry in os.scandir(second.path):
                    try:
                        info = entry.stat()
                    except FileNotFoundError:
                        continue
                    if entry.name.endswith(TEMP_SUFFIX):
                        if now - info.st_mtime > STALE_TEMP_AGE_S and _unlink(entry.path):
                            usage.stale_temps += 1
                    elif entry.name.endswith(SUFFIX):
                        if max_age is not None and now - info.st_mtime > max_age:
                            if _unlink(entry.path):
                                usage.expired += 1
                                usage.removed_blocks += 1
                                usage.removed_bytes += info.st_size
                            continue
                        files.append((info.st_mtime, info.st_size, entry.path))
        usage.bytes = sum(size for _, size, _ in files)
        usage.blocks = len(files)
        if self._exceeds(usage.bytes, usage.blocks, incoming):
            target_bytes, target_blocks = self._targets(incoming)
            files.sort()
            for _, size, path in files:
                if usage.bytes <= target_bytes and usage.blocks <= target_blocks:
                    break
                if _unlink(path):
                    usage.bytes -= size
                    usage.blocks -= 1
                    usage.removed_blocks += 1
                    usage.removed_bytes += size
        return usage

    def _targets(self, incoming: int) -> tuple[float, float]:
        """Usage to free down to when over capacity, leaving room for ``incoming`` bytes."""
        low = self.options.gc_low_watermark
        max_bytes, max_blocks = self.options.max_bytes, self.options.max_blocks
        incoming_blocks = len(range(0, incoming, self._file_bytes))
        target_bytes = float("inf") if max_bytes is None else max_bytes * low - incoming
        target_blocks = float("inf") if max_blocks is None else max_blocks * low - incoming_blocks
        return target_bytes, target_blocks

    # -- stats -------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """``<op>_<outcome>`` counts, hits/misses, bytes, usage estimate, GC counters."""
        out = {name: float(count) for name, count in self._counts.items()}
        hits = self._counts["get_hit"]
        gets = sum(count for name, count in self._counts.items() if name.startswith("get_"))
        out["hits"] = float(hits)
        out["misses"] = float(gets - hits)
        out["used_bytes"] = float(self._used_bytes)
        out["used_blocks"] = float(self._used_blocks)
        return out


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
