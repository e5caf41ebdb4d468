"""``CopyStreams``: the side streams ``StagedTransfers`` copies on, one per direction, and the fences between them and
vLLM's compute stream.

Loads make a request wait; stores never do. On one shared stream a load would
queue behind every device-to-host copy of earlier steps, so each direction has
its own stream (``MemcpyKind``). A staging buffer is marked as used by its
direction's stream (``keep``) as soon as it is allocated, before any copy is
queued: if a copy then fails part-way, the buffer still goes back to the
compute stream's allocator only once that stream has passed every copy queued
on it. On CPU tensors there are no streams: every call is a no-op, copies run
at once.
"""

from __future__ import annotations

import contextlib

import torch

from tiercache.integrations.vllm.connector.cudart import MemcpyKind


class CopyStreams:
    """One side stream per copy direction on ``device`` (none on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._streams = {kind: torch.cuda.Stream(device=device) if self.cuda else None for kind in MemcpyKind}

    def stream(self, kind: MemcpyKind) -> torch.cuda.Stream | None:
        return self._streams[kind]

    def handle(self, kind: MemcpyKind) -> int:
        """The stream's handle for the runtime's copies (0 on CPU)."""
        stream = self._streams[kind]
        return stream.cuda_stream if stream is not None else 0

    def on(self, kind: MemcpyKind) -> contextlib.AbstractContextManager[object]:
        """``kind``'s stream as the current one (on CPU: nothing)."""
        stream = self._streams[kind]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def compute(self) -> torch.cuda.Stream | None:
        """vLLM's compute stream: the current one (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def record(self, kind: MemcpyKind | None, timing: bool = False) -> torch.cuda.Event | None:
        """An event recorded now on ``kind``'s stream, or on the compute stream (``kind`` None); None on CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self._streams[kind] if kind is not None else self.compute())
        return event

    def waits_compute(self, kind: MemcpyKind) -> None:
        """``kind``'s stream goes on only after what the compute stream has queued."""
        stream = self._streams[kind]
        if stream is not None:
            stream.wait_stream(self.compute())

    def waits_event(self, kind: MemcpyKind, event: torch.cuda.Event | None) -> None:
        stream = self._streams[kind]
        if stream is not None and event is not None:
            stream.wait_event(event)

    def compute_waits(self, kind: MemcpyKind) -> None:
        """The compute stream goes on only after what ``kind``'s stream has queued."""
        compute = self.compute()
        if compute is not None:
            compute.wait_event(self.record(kind))

    def keep(self, staging: torch.Tensor, kind: MemcpyKind) -> None:
        """``staging`` is used by ``kind``'s stream: its memory is not reused before that stream passes this point of
        its queue at the tensor's release. Called right after allocating, before any copy is queued."""
        stream = self._streams[kind]
        if stream is not None:
            staging.record_stream(stream)
