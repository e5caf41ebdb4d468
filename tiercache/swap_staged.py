"""Staged demotions for layer-major pools: gather pieces on the device, then whole blocks to the host.

Device->host DMA of small pieces (64 KiB layer pieces) measured well under the
contiguous rate on an H100, while device->device copies of the same pieces and
device->host copies of whole 2 MiB blocks run at full speed. So a demotion is
pipelined through two staging buffers of ``stage_blocks`` blocks each: one batched
DMA gathers a chunk's pieces into a buffer (the direction's stream), a second
copies the buffer's whole blocks to their slots (a drain stream) while the next
chunk is gathered into the other buffer. Only copy engines are used; the cost is
``2 * stage_blocks * bytes_per_block`` of device memory, taken at the first demotion.
Loads and block-major pools go the plain batched-DMA way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.layout import KVLayout
from tiercache.swap_cuda import CopyDirection, record
from tiercache.swap_dma import DmaSwapper

STAGE_BLOCKS = 32
"""Blocks per staging buffer (two buffers): 64 MiB each for 2 MiB blocks."""


class StagedDmaSwapper(DmaSwapper):
    """Batched DMA; layer-major demotions gathered on the device first (double-buffered)."""

    name = "dma_staged"

    def __init__(
        self,
        layout: KVLayout,
        pool: Sequence[torch.Tensor],
        host: torch.Tensor,
        prefer_overlap: bool = True,
        lanes: int = 1,
        stage_blocks: int = STAGE_BLOCKS,
    ) -> None:
        super().__init__(layout, pool, host, prefer_overlap=prefer_overlap, lanes=lanes)
        self.name = "dma_staged"
        self.stage_blocks = stage_blocks
        self.drain = torch.cuda.Stream(device=self.device)
        self.buffers: list[torch.Tensor] = []
        self.drained: list[torch.cuda.Event | None] = [None, None]
        """Per buffer: the event after its last drain (the next gather into it waits for it)."""

    def _enqueue(
        self, direction: CopyDirection, batch: Any, first_piece: int, count: int, stream: torch.cuda.Stream
    ) -> None:
        if direction is CopyDirection.TO_DEVICE or self.pieces == 1:
            super()._enqueue(direction, batch, first_piece, count, stream)
            return
        if not self.buffers:
            shape = (self.stage_blocks, self.block_bytes)
            self.buffers = [torch.empty(shape, dtype=torch.uint8, device=self.device) for _ in range(2)]
        blocks, slots = batch
        self.api.make_current(self.context)
        block_bytes = np.uint64(self.block_bytes)
        for chunk, start in enumerate(range(0, len(blocks), self.stage_blocks)):
            index = chunk % 2
            buffer = self.buffers[index].data_ptr()
            part = slice(start, start + self.stage_blocks)
            positions = np.arange(len(blocks[part]), dtype=np.int64)
            if self.drained[index] is not None:
                stream.wait_event(self.drained[index])
            pool, staged = self.piece_addresses(blocks[part], positions, 0, self.pieces, buffer)
            pieces = np.full(len(pool), self.piece_bytes, dtype=np.uint64)
            self._spread(staged, pool, pieces, stream, self.lanes[direction])
            self.drain.wait_event(record(stream))
            sources = np.uint64(buffer) + positions.astype(np.uint64) * block_bytes
            destinations = np.uint64(self.host_pointer) + slots[part].astype(np.uint64) * block_bytes
            sizes = np.full(len(sources), self.block_bytes, dtype=np.uint64)
            self._copy(destinations, sources, sizes, self.drain)
            self.drained[index] = record(self.drain)
        stream.wait_stream(self.drain)
