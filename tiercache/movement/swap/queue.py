"""The swap queue: copies between the GPU pool and pinned-CPU slots, and their completion.

The only place that branches on the device. On CUDA a copy is enqueued on the
swapper's side stream at once and its completion is seen by one poller on the
background loop, which drains finished events in order (no sleep per copy, no
thread per copy). A demotion's GPU blocks go straight back to the engine, so the
engine's stream is made to wait on the copy's event before it can overwrite
them. On the CPU device (standing in for a GPU) a demotion is copied at once on
the caller's thread, for the same reason, and so is a small load of resident
blocks (``copies_now``: the hand-offs would cost more than the copy); other
copies run on one copy thread.

A load's CUDA copies wait for the device's default stream, whichever thread
starts them (the background loop, or the engine's for a load of resident
blocks), never for the engine's current stream: a load does not queue behind
the compute the engine has in flight.

Every copy returns a ``concurrent.futures.Future[bool]`` (True: the bytes landed),
resolved on the loop thread (CUDA) or the copy thread (CPU), never raising; the
``_now`` copies return that bool itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiercache.movement.runtime import CLOSE_DRAIN_SECONDS, Runtime
from tiercache.movement.swap.handles import CompletedCopy, CudaEventCopy, SwapHandle, Swapper

log = logging.getLogger(__name__)

EVENT_POLL_SECONDS = 20e-6
"""How often the poller looks at the oldest CUDA copies in flight while any are."""

INLINE_COPY_BYTES = 4 << 20
"""On the CPU device, a load of resident blocks of at most this many bytes is copied on the caller's thread: at
the 2-core host's 5-10 GB/s that takes under a millisecond, while the hand-offs to the background loop and the copy
thread and back cost a one-block load 0.2-0.3 ms (benchmarks/scaling/small_hit.py)."""

Copy = concurrent.futures.Future[bool]


@dataclass
class _InFlight:
    handle: SwapHandle
    done: Copy


class SwapQueue:
    """Runs copies through a ``Swapper`` and reports each one's completion as a future."""

    def __init__(self, swapper: Swapper, pool: list[torch.Tensor], runtime: Runtime) -> None:
        self.swapper = swapper
        self.pool = pool
        self.device = pool[0].device
        self.on_cuda = self.device.type == "cuda"
        self.runtime = runtime
        self._in_flight: list[_InFlight] = []
        self._poller: asyncio.Task[None] | None = None
        self._copy_thread = (
            None if self.on_cuda else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiercache-copy")
        )
        self._device_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.bytes_per_block = sum(tensor[0].nbytes for tensor in pool)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # ---- the three copies ---------------------------------------------------------------
    def to_host(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int], *, before_reuse: bool) -> Copy:
        """GPU blocks -> CPU slots; ``before_reuse``: the engine may overwrite the blocks next."""
        if self.on_cuda:
            handle = self.swapper.to_host(gpu_ids, cpu_slots)
            if before_reuse and handle.event is not None:
                torch.cuda.current_stream(self.device).wait_event(handle.event)
            return self._track(handle)
        if before_reuse:
            return self._run_now(lambda: self.swapper.to_host(gpu_ids, cpu_slots))
        return self._on_copy_thread(lambda: self.swapper.to_host(gpu_ids, cpu_slots))

    def to_device(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> tuple[Copy, list[Any] | None]:
        """CPU slots -> GPU blocks (a load); with the copy's per-layer CUDA events where it has them."""
        if self.on_cuda:
            with torch.cuda.stream(torch.cuda.default_stream(self.device)):  # not the engine's stream: module docstring
                handle = self.swapper.to_device(cpu_slots, gpu_ids)
            return self._track(handle), getattr(handle, "layer_events", None)
        return self._on_copy_thread(lambda: self.swapper.to_device(cpu_slots, gpu_ids)), None

    def on_device(self, sources: Sequence[int], destinations: Sequence[int]) -> Copy:
        """GPU blocks -> other GPU blocks: a resident block serving a later position of a prefix."""
        if self.on_cuda:
            stream = self._device_stream
            assert stream is not None
            stream.wait_stream(torch.cuda.default_stream(self.device))  # not the engine's stream: module docstring
            with torch.cuda.stream(stream):
                source = torch.as_tensor(list(sources), dtype=torch.long).to(self.device, non_blocking=True)
                target = torch.as_tensor(list(destinations), dtype=torch.long).to(self.device, non_blocking=True)
                for tensor in self.pool:
                    tensor.index_copy_(0, target, tensor.index_select(0, source))
                event = torch.cuda.Event()
                event.record(stream)
            return self._track(CudaEventCopy(event, (source, target)))
        return self._on_copy_thread(lambda: self._copy_blocks(sources, destinations))

    # ---- a small load the caller waits for, on the CPU device -------------------------------
    def copies_now(self, blocks: int) -> bool:
        """A load of ``blocks`` is copied on the caller's thread (``to_device_now``, ``on_device_now``): on the
        CPU device, up to ``INLINE_COPY_BYTES``."""
        return not self.on_cuda and blocks * self.bytes_per_block <= INLINE_COPY_BYTES

    def to_device_now(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> bool:
        """``to_device`` on the caller's thread (see ``copies_now``); whether the bytes landed."""
        return self._copied(lambda: self.swapper.to_device(cpu_slots, gpu_ids))

    def on_device_now(self, sources: Sequence[int], destinations: Sequence[int]) -> bool:
        """``on_device`` on the caller's thread (see ``copies_now``); whether the bytes landed."""
        return self._copied(lambda: self._copy_blocks(sources, destinations))

    def _copy_blocks(self, sources: Sequence[int], destinations: Sequence[int]) -> SwapHandle:
        for tensor in self.pool:
            for source, destination in zip(sources, destinations, strict=True):
                tensor[destination].copy_(tensor[source])
        return CompletedCopy()

    # ---- completion -------------------------------------------------------------------
    @staticmethod
    def _copied(copy: Callable[[], SwapHandle]) -> bool:
        """Run ``copy`` to its end here; whether it landed (a failure is logged, never raised)."""
        try:
            copy().wait()
        except Exception:
            log.exception("block copy failed")
            return False
        return True

    def _run_now(self, copy: Callable[[], SwapHandle]) -> Copy:
        done: Copy = concurrent.futures.Future()
        done.set_result(self._copied(copy))
        return done

    def _on_copy_thread(self, copy: Callable[[], SwapHandle]) -> Copy:
        assert self._copy_thread is not None
        done: Copy = concurrent.futures.Future()

        def run() -> None:
            done.set_result(self._copied(copy))

        self._copy_thread.submit(run)
        return done

    def _track(self, handle: SwapHandle) -> Copy:
        done: Copy = concurrent.futures.Future()
        self.runtime.call_soon(self._add, _InFlight(handle, done))
        return done

    def _add(self, item: _InFlight) -> None:
        """On the loop: remember a CUDA copy and make sure the poller runs."""
        self._in_flight.append(item)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        """Complete finished copies in order; sleep only while some are still in flight."""
        while self._in_flight:
            waiting: list[_InFlight] = []
            finished: list[_InFlight] = []
            for item in self._in_flight:
                (finished if item.handle.done() else waiting).append(item)
            self._in_flight = waiting
            for item in finished:
                item.done.set_result(True)
            if not finished:
                await asyncio.sleep(EVENT_POLL_SECONDS)

    def close(self) -> None:
        """Finish the copies in flight (CUDA: seen by the poller, for at most ``CLOSE_DRAIN_SECONDS``; CPU: on the
        copy thread) and stop the copy thread. Call while the runtime still runs: a load of resident blocks is no
        task of it, and its copies must still complete."""
        if self.on_cuda:
            self.runtime.submit(self._copies_seen(), track=False).result()
        if self._copy_thread is not None:
            self._copy_thread.shutdown(wait=True)

    async def _copies_seen(self) -> None:
        """On the loop: wait for the poller to see every CUDA copy in flight land (bounded)."""
        if self._poller is not None and not self._poller.done():
            await asyncio.wait({self._poller}, timeout=CLOSE_DRAIN_SECONDS)
