"""Block copies between the GPU pool and pinned-CPU slots (the swap queue's data mover).

``TorchSwapper`` is the portable path. On CUDA: one gather (``index_select``)
per pool tensor on the device, then one copy per contiguous run of destination
slots, on a dedicated CUDA stream with an event that the swap queue polls. On a
CPU "device" it copies each run of blocks straight into its slots: gathering
into a temporary first (``index_select``, fancy indexing) measured 5-10x slower
there, since every temporary page is faulted in anew. Faster kernels implement
the same ``Swapper`` protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tiercache.layout import KVLayout


class SwapHandle(Protocol):
    """Completion of one batched copy."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Swapper(Protocol):
    """Moves whole blocks between pool block ids and CPU slot indices."""

    def to_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> SwapHandle: ...

    def to_device(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> SwapHandle: ...


class CompletedCopy:
    """A copy that finished before its handle was returned (CPU device)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class CudaEventCopy:
    """A copy enqueued on a side stream; ``done`` polls its event without blocking."""

    def __init__(self, event: torch.cuda.Event, keep_alive: tuple[torch.Tensor, ...]) -> None:
        self.event = event
        self._keep_alive = keep_alive

    def done(self) -> bool:
        if self.event.query():
            self._keep_alive = ()
            return True
        return False

    def wait(self) -> None:
        self.event.synchronize()
        self._keep_alive = ()


def contiguous_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into (position, first slot, length) runs of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][0] + runs[-1][2] == position:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((position, slot, 1))
    return runs


def paired_runs(sources: Sequence[int], destinations: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for source, destination in zip(sources, destinations, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == source and runs[-1][1] + runs[-1][2] == destination:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((source, destination, 1))
    return runs


class TorchSwapper:
    """Batched gather/scatter with torch ops; works for both memory orders.

    Everything is moved as bytes (``uint8`` views), so any dtype works, fp8
    included, and ``host`` is the CPU tier's ``[slots, bytes_per_block]`` buffer.
    """

    def __init__(self, layout: KVLayout, pool: list[torch.Tensor], host: torch.Tensor) -> None:
        self.layout = layout
        self.pool = [tensor.view(torch.uint8).view(tensor.shape[0], -1) for tensor in pool]
        self.host = host
        self.device = pool[0].device
        self.on_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.host_pieces = host.view(host.shape[0], len(self.pool), -1)
        """``[slots, pool tensors, bytes]``: the part of each slot that each pool tensor holds."""

    def _copy_on_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int], to_host: bool) -> None:
        """CPU-device path: copy run by run, pool tensor by pool tensor, without temporaries."""
        for block, slot, length in paired_runs(gpu_ids, cpu_slots):
            for index, tensor in enumerate(self.pool):
                pool_part = tensor[block : block + length]
                host_part = self.host_pieces[slot : slot + length, index]
                if to_host:
                    host_part.copy_(pool_part)
                else:
                    pool_part.copy_(host_part)

    def _gather_device(self, ids: torch.Tensor) -> torch.Tensor:
        """The selected blocks as one contiguous ``[n, bytes_per_block]`` tensor on the device."""
        if self.layout.block_major:
            return self.pool[0].index_select(0, ids)
        return torch.cat([layer.index_select(0, ids) for layer in self.pool], dim=1)

    def _scatter_device(self, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        if self.layout.block_major:
            self.pool[0].index_copy_(0, ids, blocks)
            return
        piece = self.layout.layer_piece_bytes
        for layer_index, layer in enumerate(self.pool):
            layer.index_copy_(0, ids, blocks[:, layer_index * piece : (layer_index + 1) * piece])

    def to_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> SwapHandle:
        if not gpu_ids:
            return CompletedCopy()
        if not self.on_cuda:
            self._copy_on_host(gpu_ids, cpu_slots, to_host=True)
            return CompletedCopy()
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ids = torch.as_tensor(gpu_ids, dtype=torch.long).to(self.device, non_blocking=True)
            gathered = self._gather_device(ids)
            for position, first, length in contiguous_runs(cpu_slots):
                self.host[first : first + length].copy_(gathered[position : position + length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaEventCopy(event, (gathered, ids))

    def to_device(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> SwapHandle:
        if not gpu_ids:
            return CompletedCopy()
        if not self.on_cuda:
            self._copy_on_host(gpu_ids, cpu_slots, to_host=False)
            return CompletedCopy()
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            staging = torch.empty((len(gpu_ids), self.layout.bytes_per_block), dtype=torch.uint8, device=self.device)
            for position, first, length in contiguous_runs(cpu_slots):
                staging[position : position + length].copy_(self.host[first : first + length], non_blocking=True)
            ids = torch.as_tensor(gpu_ids, dtype=torch.long).to(self.device, non_blocking=True)
            self._scatter_device(ids, staging)
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaEventCopy(event, (staging, ids))
