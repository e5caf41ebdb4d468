"""``StagedTransfers``: a step's page copies in a few batched launches, off the compute stream (vLLM on CUDA).

vLLM's KV blocks are only ever touched on the compute stream, so nothing else
needs fencing: a block freed, preempted or slid out of a window is reused by a
later kernel on the same stream, after every copy that read or wrote it.
Per KV-cache group and step:

- stores: after each layer wrote, one gather on the compute stream packs the
  step's blocks of that layer into a device staging buffer in the slots' order
  (``[block][layer][page]``, vLLM's logical page order: the layout's
  permutation happens in the gather); at the step's end the side stream waits
  for the compute stream (an event, not a synchronize) and copies each slot's
  share device -> pinned host in one ``cudaMemcpyAsync`` (consecutive slots in
  one); its event is polled, never waited for;
- loads: the side stream copies each slot's share host -> staging, the compute
  stream waits for that event and scatters each layer into its blocks before
  the forward.

The region is registered as pinned memory (``cudaHostRegister``) once; where
registration fails copies still work, pageable and slower. Staging memory is
the caching allocator's, kept alive for the side stream by ``record_stream``.
On CPU tensors the same code runs with copies done at once (tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.integrations.vllm.connector.geometry import SlotGeometry
from tiercache.integrations.vllm.connector.pages import KVPages
from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy, Transfers
from tiercache.movement.swap.handles import contiguous_runs

log = logging.getLogger(__name__)


def register_host(memory: torch.Tensor) -> bool:
    """Register ``memory`` (host, contiguous) as pinned for DMA; False where CUDA refuses (copies stay pageable)."""
    try:
        code = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel() * memory.element_size(), 0)
    except Exception as error:  # no CUDA runtime in this build
        log.warning("tiercache connector: cannot pin the CPU tier (%s); copies stay pageable", error)
        return False
    if int(code) != 0:
        log.warning("tiercache connector: cudaHostRegister failed (%s); copies stay pageable", code)
        return False
    return True


@dataclass
class _SideCopies:
    """Copies launched on the side stream, until their end event has passed."""

    jobs: list[int]
    end: torch.cuda.Event | None
    start: torch.cuda.Event | None
    started_at: float
    load_bytes: int = 0
    store_bytes: int = 0


class StagedTransfers(Transfers):
    """See the module docstring."""

    def __init__(self, pages: KVPages, geometry: SlotGeometry, rank: int, region_slots: torch.Tensor,
                 step_budget_bytes: int | None = None) -> None:
        super().__init__(pages)
        self.geometry, self.rank, self.region_slots = geometry, rank, region_slots
        self.step_budget_bytes = step_budget_bytes
        self.cuda = pages.device.type == "cuda"
        self.side = torch.cuda.Stream(device=pages.device) if self.cuda else None
        self.pinned = register_host(region_slots) if self.cuda else False
        self._layers = {group: [i for i, layer in enumerate(pages.layers) if layer.group == group]
                        for group in range(len(geometry.groups))}
        self._store_staging: dict[int, tuple[torch.Tensor, torch.Tensor, list[GroupCopy]]] = {}
        """Per group, this step's store staging ``[blocks, layers, page]``, its block ids and the copies in it."""
        self._failed_groups: set[int] = set()
        """Groups whose staging failed this step."""
        self._loaded_this_step: set[int] = set()
        self._in_flight: list[_SideCopies] = []

    # ---- loads ------------------------------------------------------------------------------
    def load(self, copies: Sequence[GroupCopy]) -> list[int]:
        by_group: dict[int, list[GroupCopy]] = {}
        for copy in copies:
            by_group.setdefault(copy.group, []).append(copy)
        failed: list[int] = []
        self._loaded_this_step.update(copy.job_id for copy in copies)
        flight = self._begin(list(dict.fromkeys(copy.job_id for copy in copies)))
        for group, group_copies in by_group.items():
            try:
                flight.load_bytes += self._load_group(group, group_copies)
            except Exception as error:
                failed += self._failed([c.job_id for c in group_copies], "load", error)
        flight.jobs = [job for job in flight.jobs if job not in failed]
        self._end(flight)
        return failed

    def _load_group(self, group: int, copies: list[GroupCopy]) -> int:
        slots = [slot for copy in copies for slot in copy.slots]
        blocks = [block for copy in copies for block in copy.blocks]
        layers = [self.pages.layers[i] for i in self._layers[group]]
        page = layers[0].blocks[0].numel()
        staging = torch.empty((len(slots), len(layers) * page), dtype=torch.uint8, device=self.pages.device)
        shares = self._shares(group, len(layers) * page)
        self._side_waits_compute()  # the staging memory may have been the compute stream's until just now
        with self._on_side():
            for first, slot, count in _runs(slots, shares):
                staging[first : first + count].copy_(shares[slot : slot + count], non_blocking=self.pinned)
        self._compute_waits_side(staging)
        index = self._index(blocks)
        packed = staging.view(len(slots), len(layers), page)
        for position, layer in enumerate(layers):
            layer.blocks.index_copy_(0, index, packed[:, position].view(len(slots), *layer.blocks.shape[1:]))
        return len(slots) * len(layers) * page

    # ---- stores -----------------------------------------------------------------------------
    def store_layer(self, layer: int, copies: Sequence[GroupCopy]) -> list[int]:
        """The first layer of a group in a step fixes the step's copies of that group (every layer of it copies the
        same blocks); a failure fails all of them, for the rest of the step."""
        pages = self.pages.layers[layer]
        if pages.group in self._failed_groups:
            return [copy.job_id for copy in copies]
        try:
            staging, index, _ = self._store_staging.get(pages.group) or self._new_store_staging(pages.group, copies)
            position = self._layers[pages.group].index(layer)
            gathered = pages.blocks.index_select(0, index)
            staging.view(len(index), len(self._layers[pages.group]), -1)[:, position].copy_(
                gathered.view(len(index), -1))
        except Exception as error:
            self._failed_groups.add(pages.group)
            _, _, staged = self._store_staging.pop(pages.group, (None, None, list(copies)))
            return self._failed([copy.job_id for copy in staged], f"store of layer {pages.name}", error)
        return []

    def _new_store_staging(self, group: int, copies: Sequence[GroupCopy]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       list[GroupCopy]]:
        blocks = [block for copy in copies for block in copy.blocks]
        layers = len(self._layers[group])
        page = self.pages.layers[self._layers[group][0]].blocks[0].numel()
        staging = torch.empty((len(blocks), layers * page), dtype=torch.uint8, device=self.pages.device)
        index = self._index(blocks)
        entry = (staging, index, list(copies))
        self._store_staging[group] = entry
        return entry

    def end_step(self, loads: Sequence[int], stores: Sequence[int]) -> None:
        self._completed.done += [job for job in loads if job not in self._loaded_this_step]  # nothing to copy
        self._loaded_this_step = set()  # the others complete with their own copies (``load``)
        staged, self._store_staging, self._failed_groups = self._store_staging, {}, set()
        in_staging = {copy.job_id for _, _, copies in staged.values() for copy in copies}
        jobs = [job for job in stores if job in in_staging]
        self._completed.done += [job for job in stores if job not in in_staging]
        if not staged:
            return
        flight = self._begin(jobs)
        try:
            with self._on_side():
                for group, (staging, _, copies) in staged.items():
                    slots = [slot for copy in copies for slot in copy.slots]
                    shares = self._shares(group, staging.shape[1])
                    for first, slot, count in _runs(slots, shares):
                        shares[slot : slot + count].copy_(staging[first : first + count], non_blocking=self.pinned)
                    flight.store_bytes += staging.numel()
                    self._keep_for_side(staging)
        except Exception as error:
            self._completed.failed += self._failed(jobs, "store", error)
            return
        self._end(flight)

    # ---- completion -------------------------------------------------------------------------
    def poll(self) -> Completed:
        while self._in_flight and (self._in_flight[0].end is None or self._in_flight[0].end.query()):
            flight = self._in_flight.pop(0)
            seconds = (flight.start.elapsed_time(flight.end) / 1000 if flight.start is not None and flight.end
                       is not None else time.perf_counter() - flight.started_at)
            self._completed.done += flight.jobs
            self._completed.load_bytes += flight.load_bytes
            self._completed.store_bytes += flight.store_bytes
            if flight.load_bytes:
                self._completed.load_seconds += seconds
            else:
                self._completed.store_seconds += seconds
        return super().poll()

    def drain(self) -> Completed:
        for flight in self._in_flight:
            if flight.end is not None:
                flight.end.synchronize()
        return self.poll()

    # ---- streams ----------------------------------------------------------------------------
    def _index(self, blocks: list[int]) -> torch.Tensor:
        """vLLM block ids on the device, copied from pinned memory (no synchronization)."""
        host = torch.tensor(blocks, dtype=torch.long)
        return host.pin_memory().to(self.pages.device, non_blocking=True) if self.cuda else host

    def _shares(self, group: int, share_bytes: int) -> torch.Tensor:
        """``[num_slots, share_bytes]``: this rank's pages of ``group`` in every slot."""
        offset = self.geometry.offset(self.rank, group, 0)
        return self.region_slots[:, offset : offset + share_bytes]

    def _begin(self, jobs: list[int]) -> _SideCopies:
        """Copies on the side stream from here, after what the compute stream has queued (their timing starts
        then)."""
        self._side_waits_compute()
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if start is not None:
            start.record(self.side)
        return _SideCopies(jobs, None, start, time.perf_counter())

    def _end(self, flight: _SideCopies) -> None:
        if self.cuda:
            flight.end = torch.cuda.Event(enable_timing=True)
            flight.end.record(self.side)
        self._in_flight.append(flight)

    def _on_side(self) -> torch.cuda.StreamContext | _NoStream:
        return torch.cuda.stream(self.side) if self.cuda else _NoStream()

    def _side_waits_compute(self) -> None:
        if self.cuda:
            assert self.side is not None
            self.side.wait_stream(torch.cuda.current_stream(self.pages.device))

    def _compute_waits_side(self, staging: torch.Tensor) -> None:
        if self.cuda:
            assert self.side is not None
            torch.cuda.current_stream(self.pages.device).wait_stream(self.side)
            self._keep_for_side(staging)

    def _keep_for_side(self, staging: torch.Tensor) -> None:
        if self.cuda:
            staging.record_stream(self.side)


class _NoStream:
    """The CPU stand-in for a stream context: copies run at once."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None



def _runs(slots: Sequence[int], shares: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first position, first slot, count) per copy: runs of consecutive slots where a rank's share is the whole
    slot (one contiguous piece of memory), else one per slot."""
    if shares.stride(0) == shares.shape[1]:
        return contiguous_runs(slots)
    return [(position, slot, 1) for position, slot in enumerate(slots)]
