"""What the GPU check (``gpu_connector.py``) builds: KV caches as vLLM lays them out, real regions, the connector's
engines and their steps, and the seams it injects failures through (torch only: no vLLM, no xxhash).

A module of the benchmark, not a benchmark: ``gpu_connector.py`` imports it.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tiercache.integrations.vllm.connector.cudart import HostRuntime, MemcpyKind, loaded_cudart
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.pages import KVPages, page_views
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.shmfile import free_bytes
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.streams import CopyStreams
from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
"""vLLM 0.33's ``KVCacheLayout``: the physical order of the logical [L, B, H, N, C] axes."""
FULL = {"layers": 32, "heads": 8, "tokens": 16, "content": 512}
"""An 8B model's KV (Llama 3 8B: a 64 KiB page, 2 MiB a block)."""
SMALL = {"layers": 4, "heads": 2, "tokens": 16, "content": 64}
TP_LAYERS = 48
"""Layers of the TP-2 section: a 3 MiB share, so each rank registers only its own (vLLM's 3 MiB rule)."""
SLEEP_CYCLES = 20_000_000
"""The producer's delay before each hand-over: about 10 ms at 2 GHz, far longer than the copies it races."""
POISON = 0xA5
"""What staging holds before a step's copies write it (a missing wait reads it)."""
SCRATCH_BYTES = 4 << 30
"""Room the check's regions need at most (else they go to the temporary directory, a disk's)."""
BAD_DIRECTION = 99
"""A copy kind CUDA refuses (``cudaErrorInvalidMemcpyDirection``)."""


class Held(StagedTransfers):
    """Copies that stay in flight until ``released`` (and, on CUDA, until their event has passed)."""

    released = False

    def _ended(self, flight: Any) -> bool:
        return self.released and super()._ended(flight)


class Syncing(StagedTransfers):
    """An engine with a synchronizing call inside error handling that swallows what torch's "error" mode raises."""

    def _begin(self, jobs: list[int], kind: MemcpyKind) -> Any:
        with contextlib.suppress(RuntimeError):  # what torch's "error" mode raises, swallowed
            torch.zeros(1, device=self.pages.device).item()
        return super()._begin(jobs, kind)


class FailingCopies:
    """The runtime, with every copy of ``kind`` handed to it with a direction CUDA refuses."""

    def __init__(self, runtime: Any, kind: MemcpyKind) -> None:
        self.runtime, self.kind = runtime, kind

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, kind: Any,
                  stream: int) -> int:
        wrong = BAD_DIRECTION if kind is self.kind else kind
        return self.runtime.memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, wrong, stream)

    def memcpy(self, dst: int, src: int, count: int, kind: Any, stream: int) -> int:
        return self.runtime.memcpy(dst, src, count, BAD_DIRECTION if kind is self.kind else kind, stream)

    def memcpy_batch(self, dsts: Any, srcs: Any, sizes: Any, kind: Any, stream: int) -> int:
        return self.runtime.memcpy_batch(dsts, srcs, sizes, BAD_DIRECTION if kind is self.kind else kind, stream)


class Widened(CopyStreams):
    """``CopyStreams`` whose side streams sleep (``torch.cuda._sleep``) before their copies, with fresh store rows
    poisoned and the ``broken`` guard off (``gpu_connector_breaks``): a missing wait reads poison or what was there
    before. ``store_step`` delays the compute stream before a step's gathers the same way."""

    def __init__(self, device: torch.device, broken: str | None, delay: int = SLEEP_CYCLES) -> None:
        super().__init__(device)
        self.broken, self.delay = broken, delay if self.cuda else 0
        """Cycles each side stream sleeps before its copies (0: none, for the timed sections)."""
        if broken == "one-stream" and self.cuda:
            self._streams[MemcpyKind.DEVICE_TO_HOST] = self._streams[MemcpyKind.HOST_TO_DEVICE]

    def on(self, kind: MemcpyKind) -> contextlib.AbstractContextManager[object]:
        context = super().on(kind)
        if self.delay:  # the load stream produces what the scatter reads; a store's copy runs after a reuse it races
            with super().on(kind):
                torch.cuda._sleep(self.delay)
        return context

    def waits_compute(self, kind: MemcpyKind) -> None:
        if self.broken != "no-wait":
            super().waits_compute(kind)

    def waits_event(self, kind: MemcpyKind, event: torch.cuda.Event | None) -> None:
        if self.broken != "no-wait":
            super().waits_event(kind, event)

    def compute_waits(self, kind: MemcpyKind) -> None:
        if self.broken != "no-wait":
            super().compute_waits(kind)

    def keep(self, staging: torch.Tensor, kind: MemcpyKind) -> None:
        if self.cuda and kind is MemcpyKind.DEVICE_TO_HOST:  # fresh store rows, before the step's gathers
            staging.fill_(POISON)
        if self.broken != "no-record-stream":
            super().keep(staging, kind)


class Check:
    """The run's context: device, runtime, a scratch directory of regions, and the checks' verdicts."""

    def __init__(self, device: torch.device, seed: int = 0, broken: str | None = None) -> None:
        self.device, self.cuda, self.broken = device, device.type == "cuda", broken
        self.runtime = loaded_cudart() if self.cuda else HostRuntime()
        shm = Path("/dev/shm")
        roomy = shm.is_dir() and free_bytes(shm) >= SCRATCH_BYTES
        self.dir = Path(tempfile.mkdtemp(prefix="tiercache-gpu-check-", dir=shm if roomy else None))
        self.random = random.Random(seed)
        self.checks: dict[str, bool] = {}
        self._regions = 0

    def region(self, slots: int, slot_bytes: int) -> SharedRegion:
        self._regions += 1
        return SharedRegion.for_worker(self.dir / f"tiercache-check{self._regions}-dp0", slots, slot_bytes, 0)

    def kv(self, layout: str, shape: dict[str, int], blocks: int, prefix: str = "model.layers") -> dict:
        """One allocation viewed per layer as ``[B, H, N, C]`` bytes in ``layout``'s physical order (vLLM's code)."""
        full = (shape["layers"], blocks, shape["heads"], shape["tokens"], shape["content"])
        strides, step = [0] * 5, 1
        for dim in reversed(LAYOUTS[layout]):
            strides[dim], step = step, step * full[dim]
        raw = torch.randint(0, 256, (step,), dtype=torch.uint8, device=self.device)
        view = torch.as_strided(raw, full, strides)
        return {f"{prefix}.{index}.attn": view[index] for index in range(shape["layers"])}

    def engine(self, geometry: SlotGeometry, kv: dict, region: SharedRegion, rank: int = 0, runtime: Any = None,
               kind: type[StagedTransfers] = StagedTransfers, timed: bool = False) -> StagedTransfers:
        """An engine over ``region`` whose streams widen races (``Widened``; ``timed``: no delays, for figures)."""
        pages = KVPages(page_views(kv, geometry), geometry, rank, region.slots)
        return kind(pages, geometry, rank, region.slots, runtime=runtime or self.runtime,
                    streams=Widened(self.device, self.broken, 0 if timed else SLEEP_CYCLES))

    def scattered(self, count: int, space: int) -> tuple[int, ...]:
        return tuple(self.random.sample(range(space), count))

    def settle(self, copies: StagedTransfers) -> Completed:
        completed = copies.drain()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return completed

    def launch_works(self) -> bool:
        """A kernel launch and a synchronize succeed (no CUDA error left set by what ran before)."""
        if not self.cuda:
            return True
        try:
            torch.ones(4, device=self.device).add_(1).sum().item()
            return True
        except RuntimeError:
            return False

    def syncs(self, run: Callable[[], object]) -> int | None:
        """Synchronizing CUDA calls ``run`` made (None on CPU), seen as warnings: nothing can swallow those."""
        if not self.cuda:
            run()
            return None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(warning.message) for warning in caught)

    def timed(self, run: Callable[[], object], repeats: int) -> float:
        """Median seconds of ``run`` until the device is idle again (after a warm-up)."""
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            run()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])


def one_group(kv: dict, world: int = 1) -> SlotGeometry:
    first = next(iter(kv.values()))
    return SlotGeometry((GroupGeometry(GroupKind.FULL, tuple(kv), first[0].numel()),), world, first.shape[2])


def store_step(copies: StagedTransfers, jobs: list[GroupCopy]) -> list[int]:
    """A step's stores; what its staging let go is taken at once and poisoned (a buffer freed under its copy shows)."""
    failed: set[int] = set()
    delay = getattr(copies.streams, "delay", 0)
    if delay:
        torch.cuda._sleep(delay)  # the gathers (the compute stream) are what a store's copy must wait for
    for index, layer in enumerate(copies.pages.layers):
        failed.update(copies.store_layer(index, [j for j in jobs if j.group == layer.group and j.job_id not in failed]))
    let_go = [staging.rows.numel() for staging in copies._store_staging.values()]
    copies.end_step([], list(dict.fromkeys(job.job_id for job in jobs)))
    if copies.cuda:
        for nbytes in let_go:
            torch.empty(nbytes, dtype=torch.uint8, device=copies.pages.device).fill_(POISON)
    return sorted(failed)


def load_step(copies: StagedTransfers, jobs: list[GroupCopy]) -> list[int]:
    """A step's loads into load chunks poisoned first (a scatter that does not wait reads the poison)."""
    for buffer in copies.pool._loads:
        if buffer.tensor is not None:
            buffer.tensor.fill_(POISON)
    failed = copies.load(jobs)
    copies.end_step(list(dict.fromkeys(job.job_id for job in jobs)), [])
    return failed


def equal_pages(one: dict, one_blocks: tuple[int, ...], other: dict, other_blocks: tuple[int, ...]) -> bool:
    index = torch.tensor(one_blocks, device=next(iter(one.values())).device)
    other_index = torch.tensor(other_blocks, device=index.device)
    return all(torch.equal(one[name][index], other[name][other_index]) for name in one)


