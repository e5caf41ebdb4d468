"""Block copies between the GPU pool and pinned-CPU slots (the swap queue's data mover).

``make_swapper`` picks, per pool memory order and per direction, the fastest
path that works on the device, in the order measured on an H100
(``benchmarks/swap_cuda.json``), falling back to the pure-torch path; a pool on
the CPU always gets ``TorchSwapper``'s copy-in-place path. The paths:

* ``SwapPath.DMA_BATCH``: all pieces in one ``cuMemcpyBatchAsync`` (``tiercache.movement.swap.dma``), optionally
  dealt over several streams (``lanes``);
* ``SwapPath.KERNEL``: a CuPy gather/scatter kernel over mapped pinned memory (``tiercache.movement.swap.kernel``);
* ``SwapPath.TORCH_RUNS``: one torch ``copy_`` per run of blocks (``tiercache.movement.swap.torch_ops``);
* ``SwapPath.TORCH_GATHER``: ``index_select`` + copies, the portable fallback (``tiercache.movement.swap.torch_ops``).

The contract (``Swapper``, ``SwapHandle`` with ``done``/``wait``/``event``/``layer_events``)
is in ``tiercache.movement.swap.handles``; the package (``tiercache.movement.swap``) exports both.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tiercache.blocks.layout import KVLayout, MemoryOrder
from tiercache.movement.swap.cuda import CopyDirection, StreamSwapper
from tiercache.movement.swap.handles import SwapHandle, Swapper
from tiercache.movement.swap.torch_ops import TorchRunsSwapper, TorchSwapper

log = logging.getLogger(__name__)


class SwapPath(enum.Enum):
    """One implementation of the data mover."""

    DMA_BATCH = "dma_batch"
    KERNEL = "kernel"
    TORCH_RUNS = "torch_runs"
    TORCH_GATHER = "torch_gather"


@dataclass(frozen=True)
class PathChoice:
    """A path with its settings: ``lanes`` and ``prefer_overlap`` tune ``DMA_BATCH``, ``grid`` tunes ``KERNEL``."""

    path: SwapPath
    lanes: int = 1
    prefer_overlap: bool = True
    grid: int | None = None


DMA = PathChoice(SwapPath.DMA_BATCH)
DMA_LANES = PathChoice(SwapPath.DMA_BATCH, lanes=8)
"""Small pieces device->host: eight streams, so several copy engines share one batch. Layer-major
demotions on an H100 (64 KiB pieces): one stream 0.63-0.81 of a contiguous copy, eight 0.72-0.95."""
FALLBACK = PathChoice(SwapPath.TORCH_GATHER)
PREFERENCE: dict[tuple[MemoryOrder, CopyDirection], tuple[PathChoice, ...]] = {
    (MemoryOrder.BLOCK_MAJOR, CopyDirection.TO_HOST): (DMA, PathChoice(SwapPath.TORCH_RUNS)),
    (MemoryOrder.BLOCK_MAJOR, CopyDirection.TO_DEVICE): (DMA, PathChoice(SwapPath.TORCH_RUNS)),
    (MemoryOrder.LAYER_MAJOR, CopyDirection.TO_HOST): (DMA_LANES, FALLBACK),
    (MemoryOrder.LAYER_MAJOR, CopyDirection.TO_DEVICE): (DMA, FALLBACK),
}
"""Paths to try per memory order and direction, best first, as measured on an H100 (four runs;
the last is ``benchmarks/swap_cuda.json``): batched DMA everywhere. The zero-copy kernel moves
layer-major demotions as fast as eight DMA lanes (0.87-1.06) but adds 90-107% to a busy engine
step (it holds multiprocessors the engine's kernels wait for); loads keep one stream, since
lanes cost more host time per layer than 64-block layers take to copy. The torch gather path
always ends the list."""


def build_swapper(
    choice: SwapPath | PathChoice, layout: KVLayout, pool: Sequence[torch.Tensor], host: torch.Tensor
) -> StreamSwapper:
    """One swapper of the given path (raises where it cannot run here)."""
    if isinstance(choice, SwapPath):
        choice = PathChoice(choice)
    if choice.path is SwapPath.DMA_BATCH:
        from tiercache.movement.swap.dma import DmaSwapper

        return DmaSwapper(layout, pool, host, prefer_overlap=choice.prefer_overlap, lanes=choice.lanes)
    if choice.path is SwapPath.KERNEL:
        from tiercache.movement.swap.kernel import DEFAULT_GRID, KernelSwapper

        return KernelSwapper(layout, pool, host, grid=choice.grid or DEFAULT_GRID)
    if choice.path is SwapPath.TORCH_RUNS:
        return TorchRunsSwapper(layout, pool, host)
    return TorchSwapper(layout, pool, host)


class SplitSwapper:
    """Demotions through one swapper, loads through another (each the fastest for its direction)."""

    def __init__(self, out: Swapper, back: Swapper) -> None:
        self.out = out
        self.back = back

    @property
    def paths(self) -> tuple[str, str]:
        """Names of the (to_host, to_device) paths in use."""
        return (getattr(self.out, "name", "?"), getattr(self.back, "name", "?"))

    def to_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> SwapHandle:
        """A demotion through the demotion swapper."""
        return self.out.to_host(gpu_ids, cpu_slots)

    def to_device(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> SwapHandle:
        """A load through the load swapper."""
        return self.back.to_device(cpu_slots, gpu_ids)


def make_swapper(
    layout: KVLayout,
    pool_tensors: Sequence[torch.Tensor],
    host_buffer: torch.Tensor,
    preference: Callable[[MemoryOrder, CopyDirection], Sequence[PathChoice]] | None = None,
) -> Swapper:
    """The fastest swapper available for this pool and host buffer.

    ``preference`` overrides the measured order (tests and benchmarks use it).
    A path that cannot be built here (no CuPy, an old driver, an unmapped host
    buffer) is logged and skipped.
    """
    if pool_tensors[0].device.type != "cuda":
        return TorchSwapper(layout, pool_tensors, host_buffer)
    built: dict[PathChoice, StreamSwapper] = {}
    chosen: list[StreamSwapper] = []
    for direction in (CopyDirection.TO_HOST, CopyDirection.TO_DEVICE):
        order = preference(layout.memory, direction) if preference else PREFERENCE[(layout.memory, direction)]
        for choice in (*order, FALLBACK):
            if choice not in built:
                try:
                    built[choice] = build_swapper(choice, layout, pool_tensors, host_buffer)
                except (ImportError, OSError, RuntimeError, AttributeError) as error:
                    log.info("swap path %s unavailable: %s", choice, error)
                    continue
            chosen.append(built[choice])
            break
    out, back = chosen
    return out if out is back else SplitSwapper(out, back)
