"""``CudartLibrary.memcpy_batch``: a batch of copies through vLLM's own ``swap_blocks_batch`` where it can go, one
``cudaMemcpyAsync`` a piece where it cannot (issue 53, #6).

The library's calls into the CUDA runtime are replaced by ones on host memory
(this machine has no CUDA runtime), and vLLM's op by a recording one: what is
checked is which way each batch goes and with which arguments, in the order
vLLM's op takes them (sources, destinations, sizes).
"""

from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tiercache.integrations.vllm.connector.cudart import SUCCESS, CudartLibrary, MemcpyKind, vllm_batch_copy

STREAM = 7
"""The current stream's handle as the library sees it."""


def library(batch: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[CudartLibrary, list[tuple[int, int, int]]]:
    """A ``CudartLibrary`` whose runtime copies on host memory (recorded) and whose batch op is ``batch``."""
    runtime = CudartLibrary.__new__(CudartLibrary)
    copies: list[tuple[int, int, int]] = []

    def memcpy(dst: int, src: int, count: int, kind: int, stream: int) -> int:
        copies.append((dst, src, count))
        ctypes.memmove(dst, src, count)
        return SUCCESS

    runtime._memcpy, runtime._last_error, runtime.batch = memcpy, lambda: SUCCESS, batch
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: SimpleNamespace(cuda_stream=STREAM))
    return runtime, copies


def buffers() -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    source = torch.arange(64, dtype=torch.uint8)
    target = torch.zeros(64, dtype=torch.uint8)
    srcs = [source.data_ptr() + offset for offset in (0, 16, 40)]
    dsts = [target.data_ptr() + offset for offset in (8, 32, 48)]
    return source, target, srcs, dsts, [8, 8, 16]


def test_a_batch_on_the_current_stream_is_one_call_of_vllms_op_with_sources_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[list[int]]] = []
    runtime, copies = library(lambda *tensors: calls.append([tensor.tolist() for tensor in tensors]), monkeypatch)
    _, _, srcs, dsts, sizes = buffers()
    assert runtime.memcpy_batch(dsts, srcs, sizes, MemcpyKind.DEVICE_TO_HOST, STREAM) == SUCCESS
    assert calls == [[srcs, dsts, sizes]] and copies == []


def test_a_batch_on_another_stream_goes_one_copy_a_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    runtime, copies = library(lambda *tensors: calls.append(tensors), monkeypatch)
    source, target, srcs, dsts, sizes = buffers()
    assert runtime.memcpy_batch(dsts, srcs, sizes, MemcpyKind.HOST_TO_DEVICE, STREAM + 1) == SUCCESS
    assert calls == [] and copies == list(zip(dsts, srcs, sizes, strict=True))
    assert torch.equal(target[8:16], source[0:8]) and torch.equal(target[48:64], source[40:56])


def test_an_op_that_raises_is_let_go_for_good_and_its_batch_copied_one_piece_at_a_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[object] = []

    def failing(*tensors: torch.Tensor) -> None:
        calls.append(tensors)
        raise RuntimeError("cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE")

    runtime, copies = library(failing, monkeypatch)
    source, target, srcs, dsts, sizes = buffers()
    with caplog.at_level(logging.WARNING):
        assert runtime.memcpy_batch(dsts, srcs, sizes, MemcpyKind.DEVICE_TO_HOST, STREAM) == SUCCESS
        assert runtime.memcpy_batch(dsts[:1], srcs[:1], sizes[:1], MemcpyKind.DEVICE_TO_HOST, STREAM) == SUCCESS
    assert len(calls) == 1 and runtime.batch is None
    assert copies == [*zip(dsts, srcs, sizes, strict=True), (dsts[0], srcs[0], sizes[0])]
    assert torch.equal(target[32:40], source[16:24])
    assert sum("one by one from now on" in record.getMessage() for record in caplog.records) == 1


def test_vllms_cpu_build_has_no_batch_op_so_none_is_taken() -> None:
    """The CPU build's ops lack ``swap_blocks_batch`` (a CUDA op): nothing is taken that would fail at the first
    store."""
    assert vllm_batch_copy() is None
