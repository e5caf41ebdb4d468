"""The swap queue and its data movers: block copies between the GPU pool and pinned-CPU slots.

``paths`` picks a mover per pool layout and device (``make_swapper``); ``handles``
is the contract every mover keeps; ``torch_ops``, ``cuda``, ``dma`` and
``kernel`` are the movers; ``queue`` runs them for the manager.
"""

from tiercache.movement.swap.cuda import CopyDirection
from tiercache.movement.swap.handles import (
    CompletedCopy,
    CudaEventCopy,
    SwapHandle,
    Swapper,
    contiguous_runs,
    paired_runs,
)
from tiercache.movement.swap.paths import PathChoice, SplitSwapper, SwapPath, build_swapper, make_swapper
from tiercache.movement.swap.torch_ops import TorchRunsSwapper, TorchSwapper

__all__ = [
    "CompletedCopy",
    "CopyDirection",
    "CudaEventCopy",
    "PathChoice",
    "SplitSwapper",
    "SwapHandle",
    "SwapPath",
    "Swapper",
    "TorchRunsSwapper",
    "TorchSwapper",
    "build_swapper",
    "contiguous_runs",
    "make_swapper",
    "paired_runs",
]
