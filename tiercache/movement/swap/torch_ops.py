"""Block copies with plain torch ops: the portable fallback, and the CPU-device path.

``TorchSwapper`` on CUDA: one gather (``index_select``) of the selected blocks on
the device, then one copy per contiguous run of destination slots (loads: the
reverse, then one ``index_copy_`` per layer). On a CPU "device" it copies each run
of blocks straight into its slots: gathering into a temporary first measured 5-10x
slower there, since every temporary page is faulted in anew. Each run there is
one numpy memcpy on the calling thread, not torch's ``copy_``, which splits a copy
over its intra-op threads: those are the engine's compute threads, they spin on
after the copy and slow what runs next, and on a loaded 2-core host a 128 KiB run
took 20 ms at p99 through torch, 1 ms through numpy (whose call also costs a few
µs less). An idle host copies a 2 MiB block up to 1.5x faster over two threads;
the GPU the CPU device stands in for copies on its DMA engines, using no core.

``TorchRunsSwapper`` (CUDA only) skips the gather: one ``copy_`` per run of
consecutive blocks and slots and per piece, so pure DMA; fine for block-major
blocks of megabytes, slow for layer-major pieces of tens of kilobytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.blocks.layout import KVLayout
from tiercache.movement.swap.cuda import CopyDirection, StreamSwapper
from tiercache.movement.swap.handles import CompletedCopy, SwapHandle, check_pairs, contiguous_runs, paired_runs


class TorchSwapper(StreamSwapper):
    """Batched gather/scatter with torch ops; works for both memory orders and any device.

    Everything is moved as bytes (``uint8`` views), so any dtype works, fp8
    included, and ``host`` is the CPU tier's ``[slots, bytes_per_block]`` buffer.
    """

    name = "torch_gather"

    def __init__(self, layout: KVLayout, pool: Sequence[torch.Tensor], host: torch.Tensor) -> None:
        super().__init__(layout, pool, host)
        self.on_cuda = self.device.type == "cuda"
        self.host_pieces = host.view(host.shape[0], self.pieces, -1)
        """``[slots, pool tensors, bytes]``: the part of each slot that each pool tensor holds."""
        if not self.on_cuda:
            self._pool_arrays = [tensor.detach().numpy() for tensor in self.pool]
            self._host_array = self.host_pieces.numpy()

    def to_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> SwapHandle:
        """On CUDA: enqueue on the demotion stream; on the CPU: copy now."""
        if self.on_cuda:
            return super().to_host(gpu_ids, cpu_slots)
        check_pairs(gpu_ids, cpu_slots)
        self._copy_on_host(gpu_ids, cpu_slots, to_host=True)
        return CompletedCopy()

    def to_device(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> SwapHandle:
        """On CUDA: enqueue on the load stream; on the CPU: copy now."""
        if self.on_cuda:
            return super().to_device(cpu_slots, gpu_ids)
        check_pairs(cpu_slots, gpu_ids)
        self._copy_on_host(gpu_ids, cpu_slots, to_host=False)
        return CompletedCopy()

    def _copy_on_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int], to_host: bool) -> None:
        """CPU-device path: copy run by run, pool tensor by pool tensor, without temporaries."""
        host = self._host_array
        for block, slot, length in paired_runs(gpu_ids, cpu_slots):
            for index, array in enumerate(self._pool_arrays):
                if length == 1:  # an integer index: a fifth cheaper than a slice, on a small hit's path
                    pool_run, host_run = array[block], host[slot, index]
                else:
                    pool_run, host_run = array[block : block + length], host[slot : slot + length, index]
                if to_host:
                    np.copyto(host_run, pool_run)
                else:
                    np.copyto(pool_run, host_run)

    def _prepare(
        self, direction: CopyDirection, blocks: np.ndarray, slots: np.ndarray, stream: torch.cuda.Stream
    ) -> list[Any]:
        ids = torch.from_numpy(blocks).to(self.device, non_blocking=True)
        if direction is CopyDirection.TO_HOST:
            return [ids, slots]
        staging = torch.empty((len(blocks), self.block_bytes), dtype=torch.uint8, device=self.device)
        for position, first, length in contiguous_runs(slots.tolist()):
            staging[position : position + length].copy_(self.host[first : first + length], non_blocking=True)
        return [ids, slots, staging]

    def _enqueue(
        self, direction: CopyDirection, batch: Any, first_piece: int, count: int, stream: torch.cuda.Stream
    ) -> None:
        ids, slots = batch[0], batch[1]
        if direction is CopyDirection.TO_HOST:
            parts = [self.pool[j].index_select(0, ids) for j in range(first_piece, first_piece + count)]
            gathered = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
            for position, first, length in contiguous_runs(slots.tolist()):
                self.host[first : first + length].copy_(gathered[position : position + length], non_blocking=True)
            batch.append(gathered)
            return
        staging = batch[2]
        for piece in range(first_piece, first_piece + count):
            part = staging[:, piece * self.piece_bytes : (piece + 1) * self.piece_bytes]
            self.pool[piece].index_copy_(0, ids, part)


class TorchRunsSwapper(StreamSwapper):
    """CUDA only: one DMA ``copy_`` per run of consecutive (block, slot) pairs and per piece."""

    name = "torch_runs"

    def __init__(self, layout: KVLayout, pool: Sequence[torch.Tensor], host: torch.Tensor) -> None:
        super().__init__(layout, pool, host)
        self.host_pieces = host.view(host.shape[0], self.pieces, -1)

    def _enqueue(
        self, direction: CopyDirection, batch: Any, first_piece: int, count: int, stream: torch.cuda.Stream
    ) -> None:
        blocks, slots = batch
        runs = paired_runs(blocks.tolist(), slots.tolist())
        if self.pieces > 1:
            runs = [(block + k, slot + k, 1) for block, slot, length in runs for k in range(length)]
        for block, slot, length in runs:
            for piece in range(first_piece, first_piece + count):
                pool_part = self.pool[piece][block : block + length]
                host_part = self.host_pieces[slot : slot + length, piece]
                if direction is CopyDirection.TO_HOST:
                    host_part.copy_(pool_part, non_blocking=True)
                else:
                    pool_part.copy_(host_part, non_blocking=True)
