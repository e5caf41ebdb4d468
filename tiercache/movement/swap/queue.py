"""The swap queue: copies between the GPU pool and pinned-CPU slots, and their completion.

The only place that branches on the device. On CUDA a copy is enqueued on the
swapper's side stream at once and its completion is seen by one poller on the
background loop, which drains finished events in order (no sleep per copy, no
thread per copy). A demotion's GPU blocks go straight back to the engine, so the
engine's stream is made to wait on the copy's event before it can overwrite
them. On the CPU device (standing in for a GPU) a demotion is copied at once on
the caller's thread, for the same reason; other copies run on one copy thread.

Every copy returns a ``concurrent.futures.Future[bool]`` (True: the bytes landed),
resolved on the loop thread (CUDA) or the copy thread (CPU), never raising.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiercache.movement.runtime import Runtime
from tiercache.movement.swap.handles import CompletedCopy, CudaEventCopy, SwapHandle, Swapper

log = logging.getLogger(__name__)

EVENT_POLL_SECONDS = 20e-6
"""How often the poller looks at the oldest CUDA copies in flight while any are."""

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
            handle = self.swapper.to_device(cpu_slots, gpu_ids)
            return self._track(handle), getattr(handle, "layer_events", None)
        return self._on_copy_thread(lambda: self.swapper.to_device(cpu_slots, gpu_ids)), None

    def on_device(self, sources: Sequence[int], destinations: Sequence[int]) -> Copy:
        """GPU blocks -> other GPU blocks: a resident block serving a later position of a prefix."""
        if self.on_cuda:
            stream = self._device_stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                source = torch.as_tensor(list(sources), dtype=torch.long).to(self.device, non_blocking=True)
                target = torch.as_tensor(list(destinations), dtype=torch.long).to(self.device, non_blocking=True)
                for tensor in self.pool:
                    tensor.index_copy_(0, target, tensor.index_select(0, source))
                event = torch.cuda.Event()
                event.record(stream)
            return self._track(CudaEventCopy(event, (source, target)))
        return self._on_copy_thread(lambda: self._copy_blocks(sources, destinations))

    def _copy_blocks(self, sources: Sequence[int], destinations: Sequence[int]) -> SwapHandle:
        for tensor in self.pool:
            for source, destination in zip(sources, destinations, strict=True):
                tensor[destination].copy_(tensor[source])
        return CompletedCopy()

    # ---- completion -------------------------------------------------------------------
    @staticmethod
    def _run_now(copy: Callable[[], SwapHandle]) -> Copy:
        done: Copy = concurrent.futures.Future()
        try:
            copy().wait()
            done.set_result(True)
        except Exception:
            log.exception("block copy failed")
            done.set_result(False)
        return done

    def _on_copy_thread(self, copy: Callable[[], SwapHandle]) -> Copy:
        assert self._copy_thread is not None
        done: Copy = concurrent.futures.Future()

        def run() -> None:
            try:
                copy().wait()
                ok = True
            except Exception:
                log.exception("block copy failed")
                ok = False
            done.set_result(ok)

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
        """Finish copies on the copy thread and stop it."""
        if self._copy_thread is not None:
            self._copy_thread.shutdown(wait=True)
