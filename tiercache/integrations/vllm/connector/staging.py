"""``StagingPool``: the device memory ``StagedTransfers`` stages pages in, taken once and reused (issue 53, #3).

vLLM sizes its KV cache to what the device has left after profiling a forward;
staging taken during a forward sits outside that budget, and a step whose
allocation fails could fail vLLM's next one. So, where a step's budget is known
(``staging_mib``, or the blocks ``max_num_batched_tokens`` fills), the pool
takes all of it when the KV caches are registered: two steps' store rows and two
load chunks. A start that cannot afford them fails there, naming the size and
the option (``StagingMemoryError``). Without a budget (tests, a caller of its
own) a step's store rows are taken fresh and load chunks grow to what a call
needs.

Reuse follows the copies: steps take the store rows in turn, and a step's stores
are gathered into rows only once the copy that read them two steps before has
ended; otherwise the step's stores are dropped (``StagingBusy``: never a wait
on the compute stream; the host runs ahead of the device, so one buffer would
find the last step's copy not yet started). A load chunk is refilled only after
the scatter that read it (an event the load stream waits on). A buffer replaced
by a larger one is marked as used by its stream before it goes, so the
allocator reuses it only after that stream passed its copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tiercache.integrations.vllm.connector.cudart import MemcpyKind
from tiercache.integrations.vllm.connector.streams import CopyStreams

MIB = 1 << 20
LOAD_BUFFERS = 2
"""Load chunks in use at a time: the load stream fills one while the other is scattered."""
STORE_BUFFERS = 2
"""Steps' store rows: a step gathers into one while the last step's copy may still read the other."""


class StagingBusy(RuntimeError):
    """A step's stores cannot be staged now: their rows are still read by an earlier step's copy, or the step
    passes its budget."""


class StagingMemoryError(RuntimeError):
    """The device cannot hold the connector's staging: raised when the KV caches are registered."""

    def __init__(self, store_bytes: int, chunk_bytes: int, device: torch.device, error: Exception) -> None:
        total = STORE_BUFFERS * store_bytes + LOAD_BUFFERS * chunk_bytes
        super().__init__(
            f"tiercache connector: cannot reserve {total / MIB:.0f} MiB of staging on {device} ({STORE_BUFFERS} x "
            f"{store_bytes / MIB:.0f} MiB for steps' stores, {LOAD_BUFFERS} x {chunk_bytes / MIB:.0f} MiB load "
            f"chunks): {error}. Lower staging_mib in kv_connector_extra_config (stores past it wait a step), or "
            "vLLM's gpu_memory_utilization")


@dataclass
class _Buffer:
    tensor: torch.Tensor | None = None
    freed: torch.cuda.Event | None = None
    """Recorded after the last read of it (a load chunk's scatter); the next fill waits for it."""
    reader: Any = None
    """The copy that last read it (store rows: the engine's flight, ``ended`` tells when it has)."""


class StagingPool:
    """``STORE_BUFFERS`` steps' store rows and ``LOAD_BUFFERS`` load chunks on one device (see the module
    docstring); ``ended(reader)``: whether a copy handed to ``end_store_step`` has ended."""

    def __init__(self, device: torch.device, streams: CopyStreams, store_bytes: int | None,
                 chunk_bytes: int, ended: Callable[[Any], bool]) -> None:
        self.device, self.streams, self.ended = device, streams, ended
        self.store_bytes = store_bytes
        """A step's store staging (None: fresh rows each time)."""
        self.chunk_bytes = chunk_bytes
        self._stores = [_Buffer() for _ in range(STORE_BUFFERS)]
        self._store_turn = 0
        self._store_used = 0
        self._loads = [_Buffer() for _ in range(LOAD_BUFFERS)]
        self._turn = 0

    def reserve(self) -> None:
        """Take every buffer now, at their full size (``StagingMemoryError`` where the device cannot)."""
        if self.store_bytes is None:
            return
        try:
            for buffer in self._stores:
                buffer.tensor = self._empty(self.store_bytes)
            for buffer in self._loads:
                buffer.tensor = self._empty(self.chunk_bytes)
        except RuntimeError as error:  # torch.OutOfMemoryError on CUDA, the CPU allocator's RuntimeError
            for buffer in (*self._stores, *self._loads):
                buffer.tensor = None
            raise StagingMemoryError(self.store_bytes, self.chunk_bytes, self.device, error) from error

    @property
    def reserved_bytes(self) -> int:
        held = [buffer.tensor for buffer in (*self._stores, *self._loads)]
        return sum(tensor.numel() for tensor in held if tensor is not None)

    # ---- stores ----------------------------------------------------------------------------
    def store_rows(self, rows: int, width: int) -> torch.Tensor:
        """``[rows, width]`` bytes of this step's store staging, after what the step took so far (``StagingBusy``:
        none free). Unbounded: a fresh buffer, marked for the store stream before any copy out of it."""
        size = rows * width
        if self.store_bytes is None:
            fresh = self._empty(size)
            self.streams.keep(fresh, MemcpyKind.DEVICE_TO_HOST)
            return fresh.view(rows, width)
        buffer, start = self._stores[self._store_turn], self._store_used
        if buffer.reader is not None and not self.ended(buffer.reader):
            raise StagingBusy(f"the store rows are still read by the copy of {STORE_BUFFERS} steps before")
        buffer.reader = None
        if start + size > self.store_bytes or buffer.tensor is None:
            raise StagingBusy(f"{rows} blocks pass the step's staging budget of {self.store_bytes / MIB:.1f} MiB")
        self._store_used = start + size
        return buffer.tensor[start : start + size].view(rows, width)

    def end_store_step(self, reader: Any) -> None:
        """The step's store rows are handed to ``reader`` (a copy; None: none launched): the next step takes the
        next rows."""
        if self.store_bytes is not None and self._store_used:
            self._stores[self._store_turn].reader = reader
            self._store_turn = (self._store_turn + 1) % STORE_BUFFERS
        self._store_used = 0

    # ---- loads -----------------------------------------------------------------------------
    def load_chunk(self, rows: int, width: int) -> tuple[torch.Tensor, int]:
        """``[rows, width]`` bytes of the next load chunk, with the load stream made to wait for its last read; and
        its turn (for ``load_read``)."""
        turn, self._turn = self._turn, (self._turn + 1) % LOAD_BUFFERS
        buffer = self._loads[turn]
        if buffer.tensor is None or buffer.tensor.numel() < rows * width:
            self._replace(buffer, max(rows * width, min(self.chunk_bytes, 2 * rows * width)),
                          MemcpyKind.HOST_TO_DEVICE)
        self.streams.waits_event(MemcpyKind.HOST_TO_DEVICE, buffer.freed)
        assert buffer.tensor is not None
        return buffer.tensor[: rows * width].view(rows, width), turn

    def load_read(self, turn: int, event: torch.cuda.Event | None) -> None:
        """The scatter out of chunk ``turn`` is queued; ``event`` passes once it ran."""
        self._loads[turn].freed = event

    def rows_per_chunk(self, width: int) -> int:
        return max(1, self.chunk_bytes // width)

    def _replace(self, buffer: _Buffer, size: int, kind: MemcpyKind) -> None:
        """A larger buffer; the old one is marked for ``kind``'s stream first (its copies may still run)."""
        if buffer.tensor is not None:
            self.streams.keep(buffer.tensor, kind)
        buffer.tensor = self._empty(size)

    def _empty(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self.device)
