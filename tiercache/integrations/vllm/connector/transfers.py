"""The worker's transfer engine: every page copy between vLLM's KV and the CPU slots goes through one of these.

One interface (``Transfers``), two engines: ``HostTransfers`` copies at once
(vLLM's CPU build: its tensors are host memory, a copy is a memcpy, nothing to
overlap); ``StagedTransfers`` (``staged``) moves a step's pages in a few batched
launches on a side stream (CUDA). Either way a caller submits a step's loads
(every layer, before the forward reads them), each layer's stores (after the
layer wrote them) and the step's end, then pulls what completed with ``poll``:
completion is polled, never waited for, and an engine never raises into the
worker: a copy that fails fails its job only. The ids ``load`` and
``store_layer`` return are failed at once (a load's blocks are recomputed in that
very step); the job itself is reported failed by ``poll``, once none of its
copies is in flight, so its slots are never given back under a copy.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy

from tiercache.integrations.vllm.connector.pages import KVPages
from tiercache.movement.swap.handles import paired_runs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupCopy:
    """One job's pages of one KV-cache group: ``slots[i]`` <-> ``blocks[i]`` for every layer of the group."""

    job_id: int
    group: int
    slots: tuple[int, ...]
    blocks: tuple[int, ...]

    @functools.cached_property
    def runs(self) -> list[tuple[int, int, int]]:
        """(first slot, first block, count) per run of consecutive pairs: worked out once, not per layer."""
        return paired_runs(list(self.slots), list(self.blocks))


@dataclass
class Completed:
    """What completed since the last ``poll``: job ids, and the bytes and seconds each direction moved."""

    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0

    def add(self, other: Completed) -> None:
        self.done += other.done
        self.failed += other.failed
        self.load_bytes += other.load_bytes
        self.load_seconds += other.load_seconds
        self.store_bytes += other.store_bytes
        self.store_seconds += other.store_seconds


class Transfers(ABC):
    """A worker's page copies (see the module docstring)."""

    step_budget_bytes: int | None = None
    """Most bytes of stores one step may stage (None: no bound); a job past it fails (a later miss, nothing else)."""

    def __init__(self, pages: KVPages) -> None:
        self.pages = pages
        self._completed = Completed()

    @abstractmethod
    def load(self, copies: Sequence[GroupCopy], *, asynchronous: bool = False) -> list[int]:
        """Copy every layer's pages of ``copies`` slot -> block, ordered before the forward that reads them (or, for
        ``asynchronous`` loads, whose requests no forward reads until they are reported, beside it); the ids of jobs
        that failed to start (their blocks must be recomputed)."""

    @abstractmethod
    def store_layer(self, layer: int, copies: Sequence[GroupCopy]) -> list[int]:
        """Copy layer ``layer``'s pages of ``copies`` block -> slot (the layer has written them); failed job ids."""

    @abstractmethod
    def end_step(self, loads: Sequence[int], stores: Sequence[int]) -> None:
        """The step's forward is over: its loads (every one ``load`` was given) and stores (every one handed to
        ``store_layer``, or with nothing for this rank to copy) are each reported once by ``poll``, done or failed."""

    def poll(self) -> Completed:
        """Jobs whose copies completed since the last call (never waits)."""
        completed, self._completed = self._completed, Completed()
        return completed

    def drain(self) -> Completed:
        """Wait for every copy in flight (shutdown only), then ``poll``."""
        return self.poll()

    def close(self) -> None:  # noqa: B027 (optional: only an engine that registered host memory has any to release)
        """Release what the engine holds (after ``drain``)."""

    def describe(self) -> str:
        """How the engine copies, for the log."""
        return "copies at once"

    def _failed(self, job_ids: Sequence[int], what: str, error: BaseException) -> list[int]:
        log.error("tiercache connector: %s failed for jobs %s: %s", what, sorted(set(job_ids)), error,
                  exc_info=error)
        return list(job_ids)


class HostTransfers(Transfers):
    """Copies at once, run by run (vLLM's CPU build): a run of consecutive slots and blocks is one strided copy;
    asynchronous loads on a copy thread of their own (torch's copies release the GIL), so the step goes on."""

    def __init__(self, pages: KVPages) -> None:
        super().__init__(pages)
        self._step = Completed()
        self._step_failed: set[int] = set()
        """Jobs whose copy failed this step (every copy is done at once: none is left in flight)."""
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._copying: dict[int, concurrent.futures.Future[Completed]] = {}
        """Asynchronous loads on the copy thread, by job id, until ``poll`` takes them."""

    def load(self, copies: Sequence[GroupCopy], *, asynchronous: bool = False) -> list[int]:
        if asynchronous and copies:
            if self._copier is None:
                self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiercache-loads")
            for job in dict.fromkeys(copy.job_id for copy in copies):
                ours = [copy for copy in copies if copy.job_id == job]
                self._copying[job] = self._copier.submit(self._load_now, ours, single_threaded=True)
            return []
        copied = self._load_now(copies)
        failed, copied.failed = copied.failed, []  # reported failed by ``end_step``, with the job
        self._step.add(copied)
        self._step_failed.update(failed)
        return failed

    def _load_now(self, copies: Sequence[GroupCopy], *, single_threaded: bool = False) -> Completed:
        """The copies, now: what they moved and which jobs failed (``failed``). ``single_threaded`` (the copy thread,
        beside the forward): numpy's memcpy, which keeps off torch's intra-op thread pool that the forward is using
        (two parallel regions at once oversubscribe the cores: a decode step stalled for 0.7 s with torch's copy)."""
        moved = Completed()
        started = time.perf_counter()
        for copy in copies:
            try:
                for layer in self._layers(copy.group):
                    for slot, block, count in copy.runs:
                        target, source = layer.blocks[block : block + count], layer.slots[slot : slot + count]
                        if single_threaded:
                            numpy.copyto(target.numpy(), source.numpy())
                        else:
                            target.copy_(source)
                        moved.load_bytes += count * layer.blocks[0].numel()
            except Exception as error:
                moved.failed += self._failed([copy.job_id], "load", error)
        moved.load_seconds = time.perf_counter() - started
        return moved

    def store_layer(self, layer: int, copies: Sequence[GroupCopy]) -> list[int]:
        failed: list[int] = []
        pages = self.pages.layers[layer]
        started = time.perf_counter()
        for copy in copies:
            try:
                for slot, block, count in copy.runs:
                    pages.slots[slot : slot + count].copy_(pages.blocks[block : block + count])
                    self._step.store_bytes += count * pages.blocks[0].numel()
            except Exception as error:
                failed += self._failed([copy.job_id], f"store of layer {pages.name}", error)
        self._step.store_seconds += time.perf_counter() - started
        self._step_failed.update(failed)
        return failed

    def end_step(self, loads: Sequence[int], stores: Sequence[int]) -> None:
        jobs = [job for job in dict.fromkeys([*loads, *stores]) if job not in self._copying]
        self._step.done += [job for job in jobs if job not in self._step_failed]
        self._step.failed += [job for job in jobs if job in self._step_failed]
        self._completed.add(self._step)
        self._step, self._step_failed = Completed(), set()

    def poll(self) -> Completed:
        for job, copy in list(self._copying.items()):
            if copy.done():
                del self._copying[job]
                moved = copy.result()
                (self._completed.failed if moved.failed else self._completed.done).append(job)
                moved.failed, moved.done = [], []
                self._completed.add(moved)
        return super().poll()

    def drain(self) -> Completed:
        concurrent.futures.wait(list(self._copying.values()))
        return self.poll()

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def _layers(self, group: int) -> list:
        return [layer for layer in self.pages.layers if layer.group == group]
