"""Zero-copy swap kernel: one CuPy ``RawKernel`` launch reads and writes mapped pinned host memory.

The CPU tier's buffer is page-locked (``cudaHostAlloc``), so with unified virtual
addressing the GPU can load and store it directly over PCIe. One launch per batch
(per layer for layer-major loads, for per-layer readiness) gathers the scattered
pool pieces into their slots, or scatters slots into pool pieces, with 16-byte
accesses when every address and size allows it (else byte by byte). Each thread
block walks whole chunks of a piece; a small grid keeps most multiprocessors for
the engine. Needs the ``cuda`` extra (CuPy built for the machine's CUDA).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiercache.blocks.layout import KVLayout
from tiercache.movement.swap.cuda import CopyDirection, StreamSwapper

KERNEL_SOURCE = r"""
template <typename T>
__global__ void copy_pieces(const unsigned long long* __restrict__ pool_pointers,
                            unsigned long long host, const long long* __restrict__ indices,
                            long long count, int first_piece, int pieces,
                            long long piece_bytes, long long block_bytes, long long chunk_bytes,
                            int to_host) {
    const long long chunks = (piece_bytes + chunk_bytes - 1) / chunk_bytes;
    const long long units = count * pieces * chunks;
    for (long long unit = blockIdx.x; unit < units; unit += gridDim.x) {
        const long long piece_index = unit / chunks;
        const long long chunk = unit - piece_index * chunks;
        const long long item = piece_index / pieces;
        const int piece = first_piece + (int)(piece_index - item * pieces);
        const long long block = indices[item];
        const long long slot = indices[count + item];
        const long long start = chunk * chunk_bytes;
        const long long rest = piece_bytes - start;
        const long long length = rest < chunk_bytes ? rest : chunk_bytes;
        char* pool_ptr = (char*)pool_pointers[piece] + block * piece_bytes + start;
        char* host_ptr = (char*)host + slot * block_bytes + (long long)piece * piece_bytes + start;
        const T* src = (const T*)(to_host ? pool_ptr : host_ptr);
        T* dst = (T*)(to_host ? host_ptr : pool_ptr);
        const long long n = length / (long long)sizeof(T);
        long long v = threadIdx.x;
        for (; v + 3 * (long long)blockDim.x < n; v += 4 * (long long)blockDim.x) {
            T r0 = src[v];
            T r1 = src[v + blockDim.x];
            T r2 = src[v + 2 * blockDim.x];
            T r3 = src[v + 3 * blockDim.x];
            dst[v] = r0;
            dst[v + blockDim.x] = r1;
            dst[v + 2 * blockDim.x] = r2;
            dst[v + 3 * blockDim.x] = r3;
        }
        for (; v < n; v += blockDim.x) {
            dst[v] = src[v];
        }
    }
}
"""
VECTOR_KERNEL = "copy_pieces<uint4>"
BYTE_KERNEL = "copy_pieces<unsigned char>"
VECTOR_BYTES = 16
"""Width of the vector loads and stores (``uint4``)."""
THREADS_PER_BLOCK = 512
CHUNK_BYTES = 64 * 1024
"""Bytes of a piece one thread block copies before moving to its next unit."""
DEFAULT_GRID = 32
"""Thread blocks per launch: enough bytes in flight to fill PCIe, few multiprocessors taken."""


def load_cupy() -> Any:
    """The ``cupy`` module, or ImportError naming the extra that provides it."""
    try:
        import cupy
    except ImportError as error:
        raise ImportError("the zero-copy swap kernel needs CuPy (the cuda extra: pip install '.[cuda]')") from error
    return cupy


class KernelSwapper(StreamSwapper):
    """Gather/scatter kernel over mapped pinned memory (CUDA with CuPy only)."""

    name = "kernel"

    def __init__(
        self, layout: KVLayout, pool: Sequence[torch.Tensor], host: torch.Tensor, grid: int = DEFAULT_GRID
    ) -> None:
        super().__init__(layout, pool, host)
        cupy = load_cupy()
        self.cupy = cupy
        self.grid = grid
        self.name = f"kernel{grid}"
        with cupy.cuda.Device(self.device.index or 0):
            attributes = cupy.cuda.runtime.pointerGetAttributes(self.host_pointer)
            self.mapped_host = int(attributes.devicePointer)
            if not self.mapped_host:
                raise RuntimeError("swap kernel: the host buffer is not mapped into the device's address space")
            module = cupy.RawModule(
                code=KERNEL_SOURCE, options=("-std=c++17",), name_expressions=[VECTOR_KERNEL, BYTE_KERNEL]
            )
            aligned = all(
                value % VECTOR_BYTES == 0
                for value in (self.mapped_host, self.piece_bytes, self.block_bytes, *self.pool_pointers.tolist())
            )
            self.kernel = module.get_function(VECTOR_KERNEL if aligned else BYTE_KERNEL)
        self.pool_table = torch.from_numpy(self.pool_pointers.view(np.int64)).to(self.device)
        self.chunk_bytes = min(CHUNK_BYTES, self.piece_bytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers the stream protocol; same stream
            self.cupy_streams = {
                direction: cupy.cuda.ExternalStream(self.streams[direction].cuda_stream, self.device.index or 0)
                for direction in CopyDirection
            }

    def _prepare(
        self, direction: CopyDirection, blocks: np.ndarray, slots: np.ndarray, stream: torch.cuda.Stream
    ) -> tuple[torch.Tensor, torch.Tensor]:
        staged = torch.from_numpy(np.concatenate([blocks, slots])).pin_memory()
        return staged, staged.to(self.device, non_blocking=True)

    def _enqueue(
        self, direction: CopyDirection, batch: Any, first_piece: int, count: int, stream: torch.cuda.Stream
    ) -> None:
        indices = batch[1]
        items = indices.shape[0] // 2
        units = items * count * -(-self.piece_bytes // self.chunk_bytes)
        args = (
            np.uint64(self.pool_table.data_ptr()),
            np.uint64(self.mapped_host),
            np.uint64(indices.data_ptr()),
            np.int64(items),
            np.int32(first_piece),
            np.int32(count),
            np.int64(self.piece_bytes),
            np.int64(self.block_bytes),
            np.int64(self.chunk_bytes),
            np.int32(direction is CopyDirection.TO_HOST),
        )
        with self.cupy.cuda.Device(self.device.index or 0):
            self.kernel((min(self.grid, units),), (THREADS_PER_BLOCK,), args, stream=self.cupy_streams[direction])
