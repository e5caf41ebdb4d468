"""The few CUDA runtime calls the connector makes itself, behind one small interface (``CudaRuntime``).

torch offers ``cudaHostRegister`` but neither ``cudaGetLastError`` (a refused
registration leaves the thread's last error set, and the next kernel launch
torch checks then fails on it, far from the cause) nor ``cudaMemcpy2DAsync``
(one copy for a run of slots whose rank's share is strided in them), and its
``cudaMemcpyAsync`` takes raw addresses. So the
connector calls the CUDA runtime torch has loaded, through ``ctypes``: the same
library instance, so the error it clears is the one torch would see
(``CudartLibrary``, as vLLM's ``cuda_wrapper`` does). Every call that fails has
its error cleared before the caller hears of it (``checked``).

Copies that are many pieces (a rank's share of each slot, registered apart:
``PinScope.SHARES``) go as one batch (``memcpy_batch``): inside vLLM on CUDA,
vLLM's own ``swap_blocks_batch`` (one ``cuMemcpyBatchAsync`` on the current
stream, what its offloader copies with); without it (the GPU check's
torch-only machine, a vLLM without the op) one ``cudaMemcpyAsync`` a piece.

``HostRuntime`` answers the same calls on host memory, so ``StagedTransfers``
on CPU tensors (tests, the GPU check's CPU half) runs the very pointer
arithmetic it runs on a GPU, and a refused registration or a failing copy is
injected by handing it a runtime that refuses, not by faking CUDA elsewhere.
"""

from __future__ import annotations

import ctypes
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(f"vllm.{__name__}")

SUCCESS = 0
INVALID_VALUE = 1
"""``cudaErrorInvalidValue``."""
INVALID_PITCH = 12
"""``cudaErrorInvalidPitchValue``: a 2-D copy's pitch below its width, or past the device's maximum pitch."""
MAX_PITCH_ATTRIBUTE = 11
"""``cudaDevAttrMaxPitch``: the largest pitch (hence row) a 2-D copy takes, 2**31 - 1 bytes on current GPUs."""
CUDA_MAX_PITCH = 2**31 - 1
"""What ``HostRuntime`` refuses past, as a GPU does."""
INVALID_DIRECTION = 21
"""``cudaErrorInvalidMemcpyDirection``: a copy's kind none of ``MemcpyKind``."""
ALREADY_REGISTERED = 712
"""``cudaErrorHostMemoryAlreadyRegistered``: a range overlapping one this process registered."""
NOT_REGISTERED = 713
"""``cudaErrorHostMemoryNotRegistered``."""
CUDART_NAME = "libcudart"
"""The runtime library's name as ``/proc/self/maps`` shows it once torch has loaded it."""


class MemcpyKind(enum.IntEnum):
    """``cudaMemcpyKind``: which way a copy goes."""

    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call failed; its error was cleared before this was raised."""


class CudaRuntime(Protocol):
    """The runtime calls the connector makes (each returns a ``cudaError_t``; 0 is success)."""

    def host_register(self, address: int, size: int) -> int: ...

    def host_unregister(self, address: int) -> int: ...

    def last_error(self) -> int:
        """``cudaGetLastError``: the thread's last error, which it resets."""
        ...

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  kind: MemcpyKind, stream: int) -> int:
        """``cudaMemcpy2DAsync`` on ``stream`` (its handle; 0 is the legacy default)."""
        ...

    def memcpy(self, dst: int, src: int, count: int, kind: MemcpyKind, stream: int) -> int:
        """``cudaMemcpyAsync`` of ``count`` contiguous bytes on ``stream``."""
        ...

    def memcpy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: MemcpyKind,
                     stream: int) -> int:
        """Contiguous copies ``srcs[i]`` -> ``dsts[i]`` of ``sizes[i]`` bytes on ``stream``, in one call where the
        runtime can (in any order among themselves; none may overlap another's destination)."""
        ...

    def max_pitch(self, device: int) -> int:
        """``cudaDevAttrMaxPitch`` of ``device``: a 2-D copy's pitches must not pass it."""
        ...


def checked(runtime: CudaRuntime, code: int, what: str) -> None:
    """Raise ``CudaRuntimeError`` for a failed call, with the thread's last error cleared first."""
    if code != SUCCESS:
        runtime.last_error()
        raise CudaRuntimeError(f"{what} failed with CUDA error {code}")


class CudartLibrary:
    """The CUDA runtime torch loaded, called through ``ctypes``."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self._register = _function(lib, "cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint])
        self._unregister = _function(lib, "cudaHostUnregister", [ctypes.c_void_p])
        self._last_error = _function(lib, "cudaGetLastError", [])
        self._memcpy_2d = _function(lib, "cudaMemcpy2DAsync", [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
            ctypes.c_int, ctypes.c_void_p])
        self._memcpy = _function(lib, "cudaMemcpyAsync", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                          ctypes.c_int, ctypes.c_void_p])
        self._attribute = _function(lib, "cudaDeviceGetAttribute", [ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                                                    ctypes.c_int])
        self.path = path
        self.batch = vllm_batch_copy()
        """vLLM's ``swap_blocks_batch`` for ``memcpy_batch`` (None: one ``cudaMemcpyAsync`` a piece)."""

    def host_register(self, address: int, size: int) -> int:
        return int(self._register(address, size, 0))

    def host_unregister(self, address: int) -> int:
        return int(self._unregister(address))

    def last_error(self) -> int:
        return int(self._last_error())

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  kind: MemcpyKind, stream: int) -> int:
        return int(self._memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, int(kind), stream))

    def memcpy(self, dst: int, src: int, count: int, kind: MemcpyKind, stream: int) -> int:
        return int(self._memcpy(dst, src, count, int(kind), stream))

    def memcpy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: MemcpyKind,
                     stream: int) -> int:
        """Through vLLM's op where ``stream`` is the current stream (the op copies on that one); an op that raises
        (the driver's error, or an op of another signature) is let go for good, and the batch copied one piece at a
        time instead (copying a piece the op copied already writes the same bytes again)."""
        if self.batch is not None and torch.cuda.current_stream().cuda_stream == stream:
            try:
                self.batch(*(torch.tensor(list(values), dtype=torch.int64) for values in (srcs, dsts, sizes)))
                return SUCCESS
            except Exception as error:
                log.warning("tiercache connector: vLLM's swap_blocks_batch failed (%s); copies go one by one from "
                            "now on", error)
                self.last_error()
                self.batch = None
        return _one_by_one(self, dsts, srcs, sizes, kind, stream)

    def max_pitch(self, device: int) -> int:
        value = ctypes.c_int(0)
        code = int(self._attribute(ctypes.byref(value), MAX_PITCH_ATTRIBUTE, device))
        checked(self, code, "cudaDeviceGetAttribute(cudaDevAttrMaxPitch)")
        return value.value


def _one_by_one(runtime: CudaRuntime, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                kind: MemcpyKind, stream: int) -> int:
    """A batch as one ``memcpy`` a piece, up to the first that fails (its code)."""
    for dst, src, size in zip(dsts, srcs, sizes, strict=True):
        code = runtime.memcpy(dst, src, size, kind, stream)
        if code != SUCCESS:
            return code
    return SUCCESS


def vllm_batch_copy() -> Callable[..., None] | None:
    """vLLM's ``swap_blocks_batch`` (pointer tensors on the host; the current stream), where vLLM's CUDA ops are
    loaded and have it; else None."""
    try:
        from vllm import _custom_ops as ops
    except Exception:  # no vLLM (the GPU check), or one whose CUDA ops do not load here
        return None
    if not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch") or not hasattr(ops, "swap_blocks_batch"):
        return None
    return ops.swap_blocks_batch


def _function(lib: ctypes.CDLL, name: str, argtypes: list[type]) -> ctypes._CFuncPtr:
    function = getattr(lib, name)
    function.restype, function.argtypes = ctypes.c_int, argtypes
    return function


def loaded_cudart(maps: Path = Path("/proc/self/maps")) -> CudartLibrary | None:
    """The CUDA runtime this process has loaded (torch's), or None (then nothing is registered: copies go through
    pinned bounce buffers instead; a runtime loaded apart from torch's would clear errors torch never sees)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in lines if CUDART_NAME in line.rsplit("/", 1)[-1]}
    for path in sorted(paths):
        try:
            return CudartLibrary(path)
        except (OSError, AttributeError) as error:
            log.warning("tiercache connector: cannot call the CUDA runtime %s (%s)", path, error)
    return None


@dataclass
class HostRuntime:
    """The runtime's calls on host memory (CPU tensors): registrations recorded and refused where CUDA would (a range
    overlapping one registered), copies done at once row by row and refused where CUDA would (a pitch below the
    width or past ``pitch_limit``), the last error kept until read."""

    registered: dict[int, int] = field(default_factory=dict)
    """Registered ranges: start address -> size."""
    error: int = SUCCESS
    pitch_limit: int = CUDA_MAX_PITCH
    """The device's maximum pitch (tests lower it to reach the limit with small buffers)."""

    def host_register(self, address: int, size: int) -> int:
        if size <= 0:
            return self._fail(INVALID_VALUE)
        if any(address < start + length and start < address + size for start, length in self.registered.items()):
            return self._fail(ALREADY_REGISTERED)
        self.registered[address] = size
        return SUCCESS

    def host_unregister(self, address: int) -> int:
        if self.registered.pop(address, None) is None:
            return self._fail(NOT_REGISTERED)
        return SUCCESS

    def last_error(self) -> int:
        error, self.error = self.error, SUCCESS
        return error

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  kind: MemcpyKind, stream: int) -> int:
        if kind not in tuple(MemcpyKind):
            return self._fail(INVALID_DIRECTION)
        if width > dst_pitch or width > src_pitch or max(dst_pitch, src_pitch) > self.pitch_limit:
            return self._fail(INVALID_PITCH)
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
        return SUCCESS

    def memcpy(self, dst: int, src: int, count: int, kind: MemcpyKind, stream: int) -> int:
        if kind not in tuple(MemcpyKind):
            return self._fail(INVALID_DIRECTION)
        ctypes.memmove(dst, src, count)
        return SUCCESS

    def memcpy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: MemcpyKind,
                     stream: int) -> int:
        return _one_by_one(self, dsts, srcs, sizes, kind, stream)

    def max_pitch(self, device: int) -> int:
        return self.pitch_limit

    def _fail(self, code: int) -> int:
        self.error = code
        return code
