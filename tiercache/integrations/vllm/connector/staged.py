"""``StagedTransfers``: a step's page copies in a few batched launches, off the compute stream (vLLM on CUDA).

vLLM's KV blocks are only ever touched on the compute stream, so nothing else
needs fencing: a block freed, preempted or slid out of a window is reused by a
later kernel on the same stream, after every copy that read or wrote it.
Per KV-cache group and step:

- stores: after each layer wrote, one gather on the compute stream
  (``index_select`` straight into its place) packs the step's blocks of that
  layer into a device staging buffer in the slots' order (``[block][layer]
  [page]``, vLLM's logical page order: the layout's permutation happens in the
  gather); at the step's end the store stream waits for the compute stream (an
  event, not a synchronize) and copies the rows into their slots
  (``pinning.copy_batch``): a 2-D copy (``cudaMemcpy2DAsync``) per run of
  consecutive slots where the rank's share is strided in them, and one batch of
  1-D pieces for the rest: whole-slot runs (a 2-D row of 2 GiB or more would
  pass CUDA's maximum pitch), lone slots (every slot under ``PinScope.SHARES``);
  its event is polled, never waited for.
  What one step stages is bounded (``step_budget_bytes``; the scheduler plans
  within it, the worker drops what would pass it), and taken once at start
  (``staging``): a step's stores are dropped, never waited for, while an earlier
  step's copy still reads their rows;
- loads: in chunks of at most ``load_chunk_bytes``, two buffers in turn: the
  load stream copies a chunk's slots host -> staging, the compute stream waits
  for that event and scatters each layer into its blocks while the load stream
  copies the next chunk into the other buffer.

Loads and stores each have their own side stream (``streams``), so a load never
queues behind earlier steps' stores; staging reused or freed waits for the
copies that used it (``staging``), so a copy that fails part-way never lets
memory an earlier copy still writes or reads be reused.

Host memory: the ranges of the region this rank copies are registered as pinned
memory (``pinning``). Where that is refused, or no CUDA runtime can be called,
copies go through pinned bounce buffers: one asynchronous copy per group and
step, the host side's gather (loads) done at once and its scatter (stores) once
the copy's event has passed, so no copy waits for the device.

A job fails alone: blocks or slots out of range are refused before anything is
launched, and a launch that fails fails its group's jobs. A failed job is
reported (``poll``) only once none of its copies is in flight (a hybrid job's
other groups may still be copying), so its slots are never reused under a copy;
its blocks are reported at once (the ids ``load`` returns), to be recomputed.

On CPU tensors the same code runs, copies done at once and ``HostRuntime``
answering the runtime's calls (tests, the GPU check's CPU half).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiercache.integrations.vllm.connector.cudart import CudaRuntime, HostRuntime, MemcpyKind, loaded_cudart
from tiercache.integrations.vllm.connector.geometry import SlotGeometry
from tiercache.integrations.vllm.connector.pages import KVPages
from tiercache.integrations.vllm.connector.pinning import HostPins, copy_batch, copy_runs, plan_pins
from tiercache.integrations.vllm.connector.staging import StagingBusy, StagingPool
from tiercache.integrations.vllm.connector.streams import CopyStreams
from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy, Transfers

log = logging.getLogger(f"vllm.{__name__}")

DEFAULT_LOAD_CHUNK_BYTES = 256 << 20
"""Device staging per load chunk where no step budget is given (two chunks are in use at a time)."""
BUSY_WARNING_EVERY = 100
"""Steps whose stores back-pressure dropped between two warnings."""


@dataclass
class _Flight:
    """Copies launched on the side stream, until their end event has passed."""

    jobs: list[int]
    kind: MemcpyKind
    """The direction, hence the stream, its copies run on."""
    started_at: float
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    failed: list[int] = field(default_factory=list)
    """Jobs that failed, reported with the flight: some of their copies are in it."""
    load_bytes: int = 0
    store_bytes: int = 0
    scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Stores through a bounce buffer: (bounce rows, their positions, the slots' shares, the slots), copied into the
    slots once the event has passed."""


@dataclass
class _StoreStaging:
    """One group's stores of this step: the staging rows, their vLLM block ids, and each row's (job, slot)."""

    rows: torch.Tensor
    index: torch.Tensor
    targets: list[tuple[int, int]]


class StagedTransfers(Transfers):
    """See the module docstring."""

    def __init__(self, pages: KVPages, geometry: SlotGeometry, rank: int, region_slots: torch.Tensor,
                 step_budget_bytes: int | None = None, runtime: CudaRuntime | None = None, *,
                 load_chunk_bytes: int | None = None, streams: CopyStreams | None = None) -> None:
        super().__init__(pages)
        self.geometry, self.rank, self.region_slots = geometry, rank, region_slots
        self.step_budget_bytes = step_budget_bytes
        self.load_chunk_bytes = load_chunk_bytes or (step_budget_bytes // 2 if step_budget_bytes else
                                                     DEFAULT_LOAD_CHUNK_BYTES)
        """Device staging per load chunk (by default half the step's budget): two chunks are in use at a time."""
        self.cuda = pages.device.type == "cuda"
        self.streams = streams or CopyStreams(pages.device)
        self.runtime = runtime if runtime is not None else loaded_cudart() if self.cuda else HostRuntime()
        """The CUDA runtime's calls (``cudart``); None: none can be made (copies through bounce buffers)."""
        self.max_pitch = self.runtime.max_pitch(_device_index(pages.device)) if self.runtime else 0
        """The device's largest 2-D copy pitch: longer strided rows go one by one."""
        offset, size = self._copied_range()
        self.pins = HostPins.register(self.runtime, plan_pins(region_slots, offset, size)) if self.runtime else None
        """What this engine registered (None: copies through pinned bounce buffers)."""
        self._layers = {group: [i for i, layer in enumerate(pages.layers) if layer.group == group]
                        for group in range(len(geometry.groups))}
        self._position = {i: members.index(i) for members in self._layers.values() for i in members}
        """A layer's position in its group."""
        self._store_staging: dict[int, _StoreStaging] = {}
        self._failed_groups: set[int] = set()
        """Groups whose staging failed this step."""
        self._failed_jobs: set[int] = set()
        """Stores that failed this step, none of whose copies is launched."""
        self._loaded_this_step: set[int] = set()
        self._in_flight: list[_Flight] = []
        widest = max(len(members) * pages.layers[members[0]].blocks[0].numel() for members in self._layers.values()
                     if members)
        self.pool = StagingPool(pages.device, self.streams, step_budget_bytes, max(self.load_chunk_bytes, widest),
                                self._ended)
        self.pool.reserve()  # where the budget is known: all of it now, or a start-up error naming it
        self._busy_drops = 0

    @property
    def pinned(self) -> bool:
        return self.pins is not None

    def describe(self) -> str:
        """How host memory is copied, for the log."""
        if self.pins is not None:
            return f"pinned, {self.pins.plan.describe()}"
        why = "no CUDA runtime to call" if self.runtime is None else "registration refused"
        return f"pageable ({why}): copies through pinned bounce buffers"

    # ---- loads ------------------------------------------------------------------------------
    def load(self, copies: Sequence[GroupCopy], *, asynchronous: bool = False) -> list[int]:
        by_group: dict[int, list[GroupCopy]] = {}
        for copy in copies:
            by_group.setdefault(copy.group, []).append(copy)
        jobs = list(dict.fromkeys(copy.job_id for copy in copies))
        self._loaded_this_step.update(jobs)
        flight = self._begin(jobs, MemcpyKind.HOST_TO_DEVICE)
        failed: set[int] = set()
        for group, group_copies in by_group.items():
            good, bad = self._checked(group, group_copies)
            failed.update(bad)
            try:
                flight.load_bytes += self._load_group(group, good, flight, asynchronous)
            except Exception as error:
                failed.update(self._failed([copy.job_id for copy in good], "load", error))
        flight.jobs = [job for job in jobs if job not in failed]
        flight.failed = [job for job in jobs if job in failed]
        self._end(flight)
        return flight.failed

    def _load_group(self, group: int, copies: list[GroupCopy], flight: _Flight, asynchronous: bool) -> int:
        """Staged in bounded chunks; scattered into vLLM's blocks on the compute stream (a synchronous load: the
        forward reads them next), or on the side stream (asynchronous: no forward reads them until reported)."""
        pairs = [pair for copy in copies for pair in zip(copy.slots, copy.blocks, strict=True)]
        layers = [self.pages.layers[i] for i in self._layers[group]]
        page = layers[0].blocks[0].numel()
        width = len(layers) * page
        shares = self._shares(group, width)
        per_chunk = self.pool.rows_per_chunk(width)
        streams, loads = self.streams, MemcpyKind.HOST_TO_DEVICE  # after the compute stream (``_begin``)
        for first in range(0, len(pairs), per_chunk):
            chunk = pairs[first : first + per_chunk]
            staging, turn = self.pool.load_chunk(len(chunk), width)  # after the scatter that read it last
            self._copy_in(staging, shares, [slot for slot, _ in chunk], flight)
            if not asynchronous:
                streams.compute_waits(loads)
            with streams.on(loads) if asynchronous else contextlib.nullcontext():
                index = self._index([block for _, block in chunk])
                packed = staging.view(len(chunk), len(layers), page)
                for position, layer in enumerate(layers):
                    layer.blocks.index_copy_(0, index, packed[:, position].view(len(chunk), *layer.blocks.shape[1:]))
                self.pool.load_read(turn, streams.record(loads if asynchronous else None))
        return len(pairs) * width

    def _copy_in(self, staging: torch.Tensor, shares: torch.Tensor, slots: list[int], flight: _Flight) -> None:
        """Slots -> staging rows, on the load stream."""
        with self.streams.on(MemcpyKind.HOST_TO_DEVICE):
            if self.pins is not None:
                self._copy(MemcpyKind.HOST_TO_DEVICE, staging, shares, list(enumerate(slots)))
                return
            bounce = torch.empty(staging.shape, dtype=torch.uint8, pin_memory=self.cuda)
            torch.index_select(shares, 0, torch.tensor(slots, dtype=torch.long), out=bounce)  # the host's gather
            staging.copy_(bounce, non_blocking=True)

    # ---- stores -----------------------------------------------------------------------------
    def store_layer(self, layer: int, copies: Sequence[GroupCopy]) -> list[int]:
        """The first layer of a group in a step fixes the step's copies of that group (every layer of it copies the
        same blocks); a failure fails all of them, for the rest of the step."""
        pages = self.pages.layers[layer]
        if pages.group in self._failed_groups:
            return [copy.job_id for copy in copies]
        staged = self._store_staging.get(pages.group)
        bad: list[int] = []
        if staged is None:
            copies, bad = self._checked(pages.group, copies)
            self._failed_jobs.update(bad)
        try:
            staged = staged or self._new_store_staging(pages.group, copies)
            rows = len(staged.targets)
            layers = staged.rows.view(rows, len(self._layers[pages.group]), -1)
            torch.index_select(pages.blocks, 0, staged.index,
                               out=layers[:, self._position[layer]].view(rows, *pages.blocks.shape[1:]))
        except Exception as error:
            self._failed_groups.add(pages.group)
            staged = self._store_staging.pop(pages.group, None)
            jobs = list(dict.fromkeys(job for job, _ in staged.targets)) if staged else [c.job_id for c in copies]
            self._failed_jobs.update(jobs)
            if isinstance(error, StagingBusy):
                return [*bad, *self._dropped(jobs, error)]
            return [*bad, *self._failed(jobs, f"store of layer {pages.name}", error)]
        return bad

    def _dropped(self, jobs: list[int], why: StagingBusy) -> list[int]:
        """Stores left out under back-pressure (later misses): a warning at the first, then one per hundred."""
        if self._busy_drops % BUSY_WARNING_EVERY == 0:
            log.warning("tiercache connector: %d stores not stored: %s (%d such steps so far)", len(jobs), why,
                        self._busy_drops + 1)
        self._busy_drops += 1
        return jobs

    def _new_store_staging(self, group: int, copies: Sequence[GroupCopy]) -> _StoreStaging:
        pairs = [pair for copy in copies for pair in zip(copy.slots, copy.blocks, strict=True)]
        width = len(self._layers[group]) * self.pages.layers[self._layers[group][0]].blocks[0].numel()
        rows = self.pool.store_rows(len(pairs), width)
        targets = [(copy.job_id, slot) for copy in copies for slot in copy.slots]
        staged = _StoreStaging(rows, self._index([block for _, block in pairs]), targets)
        self._store_staging[group] = staged
        return staged

    def end_step(self, loads: Sequence[int], stores: Sequence[int]) -> None:
        self._completed.done += [job for job in loads if job not in self._loaded_this_step]  # nothing to copy
        self._loaded_this_step = set()  # the others complete with their own copies (``load``)
        staged, failed = self._store_staging, self._failed_jobs
        self._store_staging, self._failed_groups, self._failed_jobs = {}, set(), set()
        self._completed.failed += [job for job in stores if job in failed]  # no copy of theirs was launched
        in_staging = {job for staging in staged.values() for job, _ in staging.targets}
        self._completed.done += [job for job in stores if job not in failed and job not in in_staging]
        jobs = [job for job in stores if job not in failed and job in in_staging]
        if not jobs:
            self.pool.end_store_step(None)
            return
        kept = set(jobs)
        flight = self._begin(jobs, MemcpyKind.DEVICE_TO_HOST)
        try:
            for group, staging in staged.items():
                pairs = [(row, slot) for row, (job, slot) in enumerate(staging.targets) if job in kept]
                self._copy_out(staging.rows, self._shares(group, staging.rows.shape[1]), pairs, flight)
                flight.store_bytes += len(pairs) * staging.rows.shape[1]
        except Exception as error:
            flight.failed, flight.jobs = self._failed(flight.jobs, "store", error), []
        self._end(flight)
        self.pool.end_store_step(flight)

    def _copy_out(self, rows: torch.Tensor, shares: torch.Tensor, pairs: list[tuple[int, int]],
                  flight: _Flight) -> None:
        """Staging rows -> slots, on the store stream (through a bounce buffer: the host's scatter when it ends)."""
        with self.streams.on(MemcpyKind.DEVICE_TO_HOST):
            if self.pins is not None:
                self._copy(MemcpyKind.DEVICE_TO_HOST, rows, shares, pairs)
                return
            bounce = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=self.cuda)
            bounce.copy_(rows, non_blocking=True)
            positions = torch.tensor([row for row, _ in pairs], dtype=torch.long)
            flight.scatters.append((bounce, positions, shares, torch.tensor([slot for _, slot in pairs])))

    # ---- completion -------------------------------------------------------------------------
    def poll(self) -> Completed:
        """What ended, whatever its order: a load is not held back behind an earlier store on the other stream."""
        ended = [flight for flight in self._in_flight if self._ended(flight)]
        if ended:
            gone = {id(flight) for flight in ended}
            self._in_flight = [flight for flight in self._in_flight if id(flight) not in gone]
        for flight in ended:
            try:
                for bounce, positions, shares, slots in flight.scatters:
                    shares.index_copy_(0, slots, bounce.index_select(0, positions))
            except Exception as error:
                flight.failed += self._failed(flight.jobs, "store", error)
                flight.jobs = []
            seconds = (flight.start.elapsed_time(flight.end) / 1000 if flight.start is not None and flight.end
                       is not None else time.perf_counter() - flight.started_at)
            self._completed.done += flight.jobs
            self._completed.failed += flight.failed
            self._completed.load_bytes += flight.load_bytes
            self._completed.store_bytes += flight.store_bytes
            if flight.load_bytes:
                self._completed.load_seconds += seconds
            elif flight.store_bytes:
                self._completed.store_seconds += seconds
        return super().poll()

    def _ended(self, flight: _Flight) -> bool:
        """Whether every copy of ``flight`` has ended (never waits)."""
        return flight.end is None or flight.end.query()

    def drain(self) -> Completed:
        for flight in self._in_flight:
            if flight.end is not None:
                flight.end.synchronize()
        return self.poll()

    def close(self) -> None:
        """Wait for the copies in flight, then unregister the host memory they used."""
        self.drain()
        if self.pins is not None:
            self.pins.close()
            self.pins = None

    # ---- host memory ------------------------------------------------------------------------
    def _copied_range(self) -> tuple[int, int]:
        """(offset, bytes) of what this rank copies in every slot: its share, or the whole slot where it also reads
        rank 0's share of a replicated group (MLA)."""
        geometry = self.geometry
        if self.rank and geometry.copies > 1 and any(group.replicated for group in geometry.groups):
            return 0, geometry.slot_bytes
        return geometry.offset(self.rank, 0, 0), geometry.rank_bytes

    def _copy(self, kind: MemcpyKind, rows: torch.Tensor, shares: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Staging rows <-> slots, ``pairs`` being (row, slot): 2-D copies of strided runs, one batch of the rest."""
        assert self.runtime is not None and self.pins is not None
        copy_batch(self.runtime, kind, self.streams.handle(kind), self.max_pitch, rows, shares,
                   copy_runs(pairs, self.pins.plan))

    def _checked(self, group: int, copies: Sequence[GroupCopy]) -> tuple[list[GroupCopy], list[int]]:
        """``copies`` whose slots and blocks are all in range, and the jobs of the others, failed here (logged): a bad
        id fails its job alone, never as a wild copy or a device-side assert."""
        blocks = self.pages.layers[self._layers[group][0]].blocks.shape[0]
        slots = self.region_slots.shape[0]
        good, bad = [], []
        for copy in copies:
            if all(0 <= slot < slots for slot in copy.slots) and all(0 <= block < blocks for block in copy.blocks):
                good.append(copy)
            else:
                bad.append(copy.job_id)
        if bad:
            self._failed(bad, f"copies of group {group}", ValueError(
                f"slots or blocks out of range (of {slots} slots and {blocks} blocks)"))
        return good, bad

    def _index(self, blocks: list[int]) -> torch.Tensor:
        """vLLM block ids on the device, copied from pinned memory (no synchronization)."""
        host = torch.tensor(blocks, dtype=torch.long)
        return host.pin_memory().to(self.pages.device, non_blocking=True) if self.cuda else host

    def _shares(self, group: int, share_bytes: int) -> torch.Tensor:
        """``[num_slots, share_bytes]``: this rank's pages of ``group`` in every slot."""
        offset = self.geometry.offset(self.rank, group, 0)
        return self.region_slots[:, offset : offset + share_bytes]

    # ---- flights ----------------------------------------------------------------------------
    def _begin(self, jobs: list[int], kind: MemcpyKind) -> _Flight:
        """Copies on ``kind``'s stream from here, after what the compute stream has queued (their timing starts
        then)."""
        self.streams.waits_compute(kind)
        return _Flight(jobs, kind, time.perf_counter(), start=self.streams.record(kind, timing=True))

    def _end(self, flight: _Flight) -> None:
        try:
            flight.end = self.streams.record(flight.kind, timing=True)
        except Exception as error:  # the device is gone: nothing is left in flight to wait for
            log.error("tiercache connector: cannot record the end of a copy: %s", error)
        self._in_flight.append(flight)


def _device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (its own, else the current one's; 0 on CPU)."""
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()
