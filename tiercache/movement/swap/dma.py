"""Batched DMA: every scattered piece of a batch in one ``cuMemcpyBatchAsync`` call (CUDA 12.8+ driver).

The copy engines move the pieces (no multiprocessor is used, so the engine's
kernels run undisturbed) and the driver enqueues the whole list at once, so
layer-major pieces of tens of kilobytes cost no per-copy launch. The address
lists are built with numpy and handed over as C arrays. The entry point is taken
from the driver with ``cuGetProcAddress`` at a fixed API version (12.8), so its
signature is the documented one whichever driver runs; ctypes rather than the
``cuda-bindings`` wrapper, which takes Python lists and would cost a Python
object per piece per call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.blocks.layout import KVLayout
from tiercache.movement.swap.cuda import CopyDirection, StreamSwapper, record

DRIVER_LIBRARY = "libcuda.so.1"
BATCH_API_VERSION = 12080
"""The CUDA version whose ``cuMemcpyBatchAsync`` signature (with ``failIdx``) we call."""
SRC_ACCESS_ORDER_STREAM = 1
"""``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``: sources are read in stream order."""
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
"""``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``: keep the copies off the multiprocessors."""
SUCCESS = 0


class MemLocation(ctypes.Structure):
    """``CUmemLocation``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


class BatchCopyApi:
    """The driver's ``cuMemcpyBatchAsync`` and what it needs (current context), bound once per process."""

    _instance: BatchCopyApi | None = None

    def __init__(self) -> None:
        driver = ctypes.CDLL(DRIVER_LIBRARY)
        function = ctypes.c_void_p()
        status = ctypes.c_int()
        driver.cuGetProcAddress_v2.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        result = driver.cuGetProcAddress_v2(
            b"cuMemcpyBatchAsync", ctypes.byref(function), BATCH_API_VERSION, 0, ctypes.byref(status)
        )
        if result != SUCCESS or not function.value:
            raise RuntimeError(f"cuMemcpyBatchAsync is not available (cuGetProcAddress: {result}, {status.value})")
        prototype = ctypes.CFUNCTYPE(
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(MemcpyAttributes),
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_void_p,
        )
        self.copy = prototype(function.value)
        self.driver = driver
        driver.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self.contexts: dict[int, ctypes.c_void_p] = {}

    def primary_context(self, ordinal: int) -> ctypes.c_void_p:
        """The device's primary context (the one the CUDA runtime, hence torch, uses)."""
        if ordinal not in self.contexts:
            device = ctypes.c_int()
            context = ctypes.c_void_p()
            for result in (
                self.driver.cuDeviceGet(ctypes.byref(device), ordinal),
                self.driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
            ):
                if result != SUCCESS:
                    raise RuntimeError(f"cannot get the primary context of device {ordinal}: CUresult {result}")
            self.contexts[ordinal] = context
        return self.contexts[ordinal]

    def make_current(self, context: ctypes.c_void_p) -> None:
        """Driver calls act on the calling thread's current context; swaps come from any thread."""
        result = self.driver.cuCtxSetCurrent(context)
        if result != SUCCESS:
            raise RuntimeError(f"cuCtxSetCurrent failed with CUresult {result}")

    @classmethod
    def get(cls) -> BatchCopyApi:
        """The process-wide binding (made on first use)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


class DmaSwapper(StreamSwapper):
    """One ``cuMemcpyBatchAsync`` per batch (per layer for layer-major loads), split over ``lanes`` streams.

    With ``lanes`` > 1 the pieces are dealt in contiguous shares to that many
    helper streams (which start after the direction's stream and which it waits
    for), so several copy engines work on one batch: small pieces device->host
    measured well under the contiguous rate through one engine.
    """

    name = "dma_batch"

    def __init__(
        self,
        layout: KVLayout,
        pool: Sequence[torch.Tensor],
        host: torch.Tensor,
        prefer_overlap: bool = True,
        lanes: int = 1,
    ) -> None:
        super().__init__(layout, pool, host)
        if lanes < 1:
            raise ValueError(f"DmaSwapper: lanes must be at least 1, got {lanes}")
        self.api = BatchCopyApi.get()
        self.attributes = MemcpyAttributes(
            srcAccessOrder=SRC_ACCESS_ORDER_STREAM, flags=FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0
        )
        self.name = f"dma_batch{'' if prefer_overlap else '_plain'}{f'_x{lanes}' if lanes > 1 else ''}"
        self.attribute_index = (ctypes.c_size_t * 1)(0)
        self.context = self.api.primary_context(
            torch.cuda.current_device() if self.device.index is None else self.device.index
        )
        self.lanes = {
            direction: [torch.cuda.Stream(device=self.device) for _ in range(lanes)] if lanes > 1 else []
            for direction in CopyDirection
        }

    def _prepare(
        self, direction: CopyDirection, blocks: np.ndarray, slots: np.ndarray, stream: torch.cuda.Stream
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every piece's source and destination address, ``[pieces, blocks]``, computed once per batch.

        A layer-major load is enqueued layer by layer; building each layer's lists
        then would cost more host time per layer than its copies take on the GPU
        for small batches, starving the copy engines.
        """
        pool, host = self.piece_addresses(blocks, slots, 0, self.pieces, self.host_pointer)
        pool = np.ascontiguousarray(pool.reshape(len(blocks), self.pieces).T)
        host = np.ascontiguousarray(host.reshape(len(blocks), self.pieces).T)
        sources, destinations = (pool, host) if direction is CopyDirection.TO_HOST else (host, pool)
        return sources, destinations, np.full(sources.shape, self.piece_bytes, dtype=np.uint64)

    def _enqueue(
        self, direction: CopyDirection, batch: Any, first_piece: int, count: int, stream: torch.cuda.Stream
    ) -> None:
        sources, destinations, sizes = (array[first_piece : first_piece + count].reshape(-1) for array in batch)
        self.api.make_current(self.context)
        self._spread(destinations, sources, sizes, stream, self.lanes[direction])

    def _spread(
        self,
        destinations: np.ndarray,
        sources: np.ndarray,
        sizes: np.ndarray,
        stream: torch.cuda.Stream,
        lanes: list[torch.cuda.Stream],
    ) -> None:
        """Copy the listed pieces in ``stream`` order: one batch, or contiguous shares over ``lanes``."""
        if len(lanes) < 2 or len(sources) < len(lanes):
            self._copy(destinations, sources, sizes, stream)
            return
        start = record(stream)
        bounds = np.linspace(0, len(sources), len(lanes) + 1).astype(int)
        for lane, first, last in zip(lanes, bounds[:-1], bounds[1:], strict=True):
            lane.wait_event(start)
            self._copy(destinations[first:last], sources[first:last], sizes[first:last], lane)
            stream.wait_event(record(lane))

    def _copy(
        self, destinations: np.ndarray, sources: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream
    ) -> None:
        """One ``cuMemcpyBatchAsync`` of the listed pieces on ``stream``."""
        failed = ctypes.c_size_t(0)
        result = self.api.copy(
            destinations.ctypes.data,
            sources.ctypes.data,
            sizes.ctypes.data,
            len(sources),
            ctypes.byref(self.attributes),
            ctypes.addressof(self.attribute_index),
            1,
            ctypes.byref(failed),
            ctypes.c_void_p(stream.cuda_stream),
        )
        if result != SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {result} at copy {failed.value}")
