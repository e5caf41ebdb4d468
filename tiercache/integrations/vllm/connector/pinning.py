"""The CPU tier's region registered as pinned memory, as vLLM's own offloader registers its region
(``vllm/v1/kv_offload/cpu/gpu_worker.py`` ``pin_mmap_region``).

A worker registers what it copies. Where a slot holds enough of other ranks'
shares (``MIN_SAVED_BYTES`` a slot, vLLM's rule), only its own share of each
slot, rounded out to pages (``PinScope.SHARES``); otherwise the whole region, in
chunks of at most ``MAX_REGISTER_BYTES`` that end on slot and page boundaries
(``PinScope.WHOLE``). A copy never spans two registrations (``copy_runs``); the
pieces a step's copies make are one batch (``copy_batch``), so a rank's shares
under ``SHARES`` are not one runtime call a slot. A
refused registration has its error cleared, what was registered is rolled back
and copies stay pageable (``staged`` then moves them through pinned bounce
buffers); ``HostPins.close`` unregisters every range, so a second engine over the
same memory in one process (tests, a restart) is not refused as "already
registered".
"""

from __future__ import annotations

import enum
import logging
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.integrations.vllm.connector.cudart import SUCCESS, CudaRuntime, MemcpyKind, checked

log = logging.getLogger(f"vllm.{__name__}")

MAX_REGISTER_BYTES = 64 << 30
"""The most one ``cudaHostRegister`` covers (vLLM's bound: drivers limit large registrations)."""
MIN_SAVED_BYTES = 3 << 20
"""A rank registers only its shares where that leaves out at least this much of every slot (vLLM's rule: fewer,
larger registrations otherwise)."""
PAGE_BYTES = mmap.PAGESIZE


class PinScope(enum.Enum):
    """What of the region one worker registers."""

    WHOLE = "the whole region"
    SHARES = "this rank's share of each slot"


@dataclass(frozen=True)
class PinPlan:
    """The ranges one worker registers, and how its copies must be cut so that none spans two of them."""

    scope: PinScope
    ranges: tuple[tuple[int, int], ...]
    """(address, bytes) per registration."""
    slots_per_range: int
    """``WHOLE``: slots per registered chunk; a run of slots is cut where a chunk ends. ``SHARES``: 1."""

    def describe(self) -> str:
        size = sum(length for _, length in self.ranges)
        return f"{self.scope.value}: {size / (1 << 20):.1f} MiB in {len(self.ranges)} registration(s)"


def plan_pins(slots: torch.Tensor, share_offset: int, share_bytes: int, page: int = PAGE_BYTES,
              max_bytes: int = MAX_REGISTER_BYTES) -> PinPlan:
    """The ranges a rank whose share is ``share_bytes`` at ``share_offset`` of each slot of ``slots`` (``[num_slots,
    slot_bytes]`` uint8, a slot a row) registers."""
    base, stride, count = slots.data_ptr(), slots.stride(0), slots.shape[0]
    if stride - share_bytes >= max(page, MIN_SAVED_BYTES):
        shares = []
        for slot in range(count):
            start = base + slot * stride + share_offset
            low, high = start - start % page, _round_up(start + share_bytes, page)
            shares.append((low, high - low))
        return PinPlan(PinScope.SHARES, tuple(shares), 1)
    aligned = page // math.gcd(stride, page)  # slots between page-aligned slot starts
    per_range = max(aligned, max_bytes // stride // aligned * aligned)
    chunks = []
    for first in range(0, count, per_range):
        start, end = base + first * stride, base + min(first + per_range, count) * stride
        low = start - start % page
        chunks.append((low, _round_up(end, page) - low))
    return PinPlan(PinScope.WHOLE, tuple(chunks), per_range)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def copy_runs(pairs: Sequence[tuple[int, int]], plan: PinPlan | None) -> list[tuple[int, int, int]]:
    """(first position, first slot, count) per copy of ``pairs`` ((staging position, slot), in staging order): runs of
    consecutive positions and slots within one registration (``plan`` None: the region is not registered, any run)."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in pairs:
        if runs:
            first, first_slot, count = runs[-1]
            follows = position == first + count and slot == first_slot + count
            if follows and (plan is None or (plan.scope is PinScope.WHOLE
                                             and slot // plan.slots_per_range == first_slot // plan.slots_per_range)):
                runs[-1] = (first, first_slot, count + 1)
                continue
        runs.append((position, slot, 1))
    return runs


def copy_batch(runtime: CudaRuntime, kind: MemcpyKind, stream: int, max_pitch: int, rows: torch.Tensor,
               shares: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
    """Each run (``copy_runs``: rows ``position:position+count`` of ``rows`` (device) <-> slots ``slot:slot+count`` of
    ``shares`` (host)) on ``stream``: one 2-D copy where the share is strided in a run of slots, the rest in one batch
    (``memcpy_batch``): whole slots as one piece a run (a 2-D row of 2 GiB or more would pass CUDA's maximum
    pitch), a lone slot (every slot under ``PinScope.SHARES``) and each row of a run past ``max_pitch`` as one each."""
    width, pitch = rows.shape[1], shares.stride(0)
    dst_pitch, src_pitch = (width, pitch) if kind is MemcpyKind.HOST_TO_DEVICE else (pitch, width)
    dsts: list[int] = []
    srcs: list[int] = []
    sizes: list[int] = []
    for position, slot, count in runs:
        device = rows.data_ptr() + position * width
        host = shares.data_ptr() + slot * pitch
        dst, src = (device, host) if kind is MemcpyKind.HOST_TO_DEVICE else (host, device)
        if pitch == width:
            dsts.append(dst)
            srcs.append(src)
            sizes.append(width * count)
        elif count > 1 and pitch <= max_pitch:
            code = runtime.memcpy_2d(dst, dst_pitch, src, src_pitch, width, count, kind, stream)
            checked(runtime, code, f"cudaMemcpy2DAsync of {count} x {width} bytes")
        else:
            dsts += [dst + row * dst_pitch for row in range(count)]
            srcs += [src + row * src_pitch for row in range(count)]
            sizes += [width] * count
    if sizes:
        code = runtime.memcpy_batch(dsts, srcs, sizes, kind, stream)
        checked(runtime, code, f"a batch of {len(sizes)} copies ({sum(sizes)} bytes)")


class HostPins:
    """The ranges one engine registered (``register``); ``close`` unregisters them."""

    def __init__(self, runtime: CudaRuntime, plan: PinPlan) -> None:
        self.runtime, self.plan = runtime, plan
        self._addresses = [address for address, _ in plan.ranges]

    @classmethod
    def register(cls, runtime: CudaRuntime, plan: PinPlan) -> HostPins | None:
        """Register every range of ``plan``; None (nothing left registered, no error left set) where one is refused."""
        done: list[int] = []
        for address, size in plan.ranges:
            try:
                code = runtime.host_register(address, size)
            except Exception as error:  # the runtime itself failed (a missing symbol, a driver gone)
                code, reason = -1, str(error)
            else:
                reason = f"CUDA error {code}"
            if code == SUCCESS:
                done.append(address)
                continue
            _clear(runtime)
            log.warning("tiercache connector: cudaHostRegister refused %d bytes at 0x%x (%s) after %d of %d "
                        "registrations; the CPU tier stays pageable (copies through pinned bounce buffers)", size,
                        address, reason, len(done), len(plan.ranges))
            for registered in reversed(done):
                _unregister(runtime, registered)
            return None
        return cls(runtime, plan)

    def close(self) -> None:
        """Unregister every range (after the copies that used them have ended)."""
        addresses, self._addresses = self._addresses, []
        for address in reversed(addresses):
            _unregister(runtime=self.runtime, address=address)


def _unregister(runtime: CudaRuntime, address: int) -> None:
    try:
        code = runtime.host_unregister(address)
    except Exception as error:
        log.warning("tiercache connector: cudaHostUnregister at 0x%x failed: %s", address, error)
        return
    if code != SUCCESS:
        _clear(runtime)
        log.warning("tiercache connector: cudaHostUnregister at 0x%x failed with CUDA error %d", address, code)


def _clear(runtime: CudaRuntime) -> None:
    """Reset the thread's last CUDA error (a failed call sets it; torch's next launch check would raise on it)."""
    try:
        runtime.last_error()
    except Exception as error:
        log.warning("tiercache connector: cudaGetLastError failed: %s", error)
