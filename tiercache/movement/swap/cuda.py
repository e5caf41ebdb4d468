"""What every CUDA swapper shares: a copy stream per direction, ordering, events, per-layer readiness.

A batch is seen as pieces: a block-major block is one piece (the whole block), a
layer-major block is one piece per layer tensor. Pool piece ``j`` of block ``b``
lies at ``pool_pointers[j] + b * piece_bytes``; host piece ``j`` of slot ``s`` at
``host + s * bytes_per_block + j * piece_bytes``. A subclass enqueues pieces on a
stream; this base makes the copy stream wait for the caller's current stream
(the engine's writes to a demoted block come first), records the completion event
after the copy and, for layer-major loads, one event after each layer, so that
``layer_events[i]`` fires once layer ``i`` of every block in the batch has landed.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.blocks.layout import KVLayout
from tiercache.movement.swap.handles import CompletedCopy, CudaEventCopy, SwapHandle, check_pairs


class CopyDirection(enum.Enum):
    """Which way a batch goes; each direction has its own copy stream."""

    TO_HOST = "to_host"
    TO_DEVICE = "to_device"


class StreamSwapper:
    """Base of the CUDA swappers: subclasses implement ``_prepare`` and ``_enqueue``."""

    name = "base"

    def __init__(self, layout: KVLayout, pool: Sequence[torch.Tensor], host: torch.Tensor) -> None:
        self.layout = layout
        self.pool = [tensor.view(torch.uint8).view(tensor.shape[0], -1) for tensor in pool]
        self.host = host
        self.device = pool[0].device
        self.pieces = len(self.pool)
        """Pieces per block: 1 block-major, the number of layers layer-major."""
        self.piece_bytes = self.pool[0].shape[1]
        self.block_bytes = layout.bytes_per_block
        if self.pieces * self.piece_bytes != self.block_bytes or host.shape[1] != self.block_bytes:
            raise ValueError("swap: pool tensors and host slots disagree on the bytes of a block")
        if self.device.type == "cuda":
            self.streams = {direction: torch.cuda.Stream(device=self.device) for direction in CopyDirection}
        self._locks = {direction: threading.Lock() for direction in CopyDirection}
        self.pool_pointers = np.array([tensor.data_ptr() for tensor in self.pool], dtype=np.uint64)
        self.host_pointer = host.data_ptr()

    @property
    def layer_wise_loads(self) -> bool:
        """Loads are enqueued layer by layer, each with its own event (layer-major pools)."""
        return self.pieces > 1

    def to_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> SwapHandle:
        """Copy pool blocks ``gpu_ids`` into host slots ``cpu_slots`` (pairwise)."""
        check_pairs(gpu_ids, cpu_slots)
        return self._submit(CopyDirection.TO_HOST, gpu_ids, cpu_slots)

    def to_device(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> SwapHandle:
        """Copy host slots ``cpu_slots`` into pool blocks ``gpu_ids`` (pairwise)."""
        check_pairs(cpu_slots, gpu_ids)
        return self._submit(CopyDirection.TO_DEVICE, gpu_ids, cpu_slots)

    def _submit(self, direction: CopyDirection, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> SwapHandle:
        if len(gpu_ids) == 0:
            return CompletedCopy()
        blocks = np.asarray(gpu_ids, dtype=np.int64)
        slots = np.asarray(cpu_slots, dtype=np.int64)
        stream = self.streams[direction]
        layer_events: list[torch.cuda.Event] | None = None
        with self._locks[direction], torch.cuda.device(self.device):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                batch = self._prepare(direction, blocks, slots, stream)
                if direction is CopyDirection.TO_DEVICE and self.layer_wise_loads:
                    layer_events = []
                    for layer in range(self.pieces):
                        self._enqueue(direction, batch, layer, 1, stream)
                        layer_events.append(record(stream))
                    event = layer_events[-1]
                else:
                    self._enqueue(direction, batch, 0, self.pieces, stream)
                    event = record(stream)
        return CudaEventCopy(event, (batch,), layer_events)

    def _prepare(
        self, direction: CopyDirection, blocks: np.ndarray, slots: np.ndarray, stream: torch.cuda.Stream
    ) -> Any:
        """Per-batch set-up on ``stream`` (index uploads, staging); kept alive until the batch is done."""
        return (blocks, slots)

    def _enqueue(
        self, direction: CopyDirection, batch: Any, first_piece: int, count: int, stream: torch.cuda.Stream
    ) -> None:
        """Enqueue pieces ``first_piece .. first_piece + count - 1`` of every block of the batch."""
        raise NotImplementedError

    def piece_addresses(
        self, blocks: np.ndarray, slots: np.ndarray, first_piece: int, count: int, host_base: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pool and host addresses of the selected pieces, block by block then piece by piece."""
        pieces = np.arange(first_piece, first_piece + count, dtype=np.uint64)
        block_offsets = blocks.astype(np.uint64) * np.uint64(self.piece_bytes)
        pool = (self.pool_pointers[pieces][None, :] + block_offsets[:, None]).ravel()
        host_offsets = slots.astype(np.uint64) * np.uint64(self.block_bytes)
        host = (np.uint64(host_base) + host_offsets[:, None] + pieces[None, :] * np.uint64(self.piece_bytes)).ravel()
        return pool, host


def record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A new event recorded on ``stream`` now."""
    event = torch.cuda.Event()
    event.record(stream)
    return event
