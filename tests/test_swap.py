"""Batched GPU<->CPU block copies: exact for both memory orders, any block and slot order.

The CPU tests run everywhere with ``device="cpu"`` standing in for the GPU pool;
the CUDA tests exercise the same swapper on a real GPU and are skipped, with the
reason shown, where none is present.
"""

from __future__ import annotations

import random

import pytest
import torch

from tiercache.layout import KVLayout, MemoryOrder
from tiercache.swap import TorchSwapper, contiguous_runs

POISON = 0x5A
DTYPES = ["float16", "bfloat16", "float8_e4m3fn", "float32"]
CUDA_REASON = "CUDA not available: the GPU swap path runs on a CUDA machine only"


def random_pool(layout: KVLayout, blocks: int, device: str) -> list[torch.Tensor]:
    pool = layout.allocate_pool(blocks, device)
    for tensor in pool:
        tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    return pool


def block_bytes(layout: KVLayout, pool: list[torch.Tensor], block: int) -> bytes:
    """A block's serialized bytes computed independently of the swapper."""
    if layout.block_major:
        return pool[0][block].cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return b"".join(t[block].cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in pool)


def check_roundtrip(layout: KVLayout, device: str, seed: int) -> None:
    rng = random.Random(seed)
    blocks, slots = 37, 29
    pool = random_pool(layout, blocks, device)
    host = torch.full((slots, layout.bytes_per_block), POISON, dtype=torch.uint8, pin_memory=device != "cpu")
    swapper = TorchSwapper(layout, pool, host)
    count = rng.choice([1, 5, 17])
    gpu_ids = rng.sample(range(blocks), count)
    cpu_slots = rng.sample(range(slots), count)
    swapper.to_host(gpu_ids, cpu_slots).wait()
    for block, slot in zip(gpu_ids, cpu_slots, strict=True):
        assert host[slot].numpy().tobytes() == block_bytes(layout, pool, block)
    untouched = set(range(slots)) - set(cpu_slots)
    assert all(bool((host[s] == POISON).all()) for s in untouched), "a copy wrote outside its slots"

    targets = rng.sample(range(blocks), count)
    expected = {t: host[s].numpy().tobytes() for t, s in zip(targets, cpu_slots, strict=True)}
    others = {b: block_bytes(layout, pool, b) for b in range(blocks) if b not in targets}
    swapper.to_device(cpu_slots, targets).wait()
    for target, data in expected.items():
        assert block_bytes(layout, pool, target) == data
    for block, data in others.items():
        assert block_bytes(layout, pool, block) == data, "a load wrote outside its blocks"


@pytest.mark.parametrize("memory", list(MemoryOrder))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_roundtrip_cpu(memory: MemoryOrder, dtype: str, seed: int) -> None:
    check_roundtrip(KVLayout(3, 2, 8, dtype, 4, memory), "cpu", seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
@pytest.mark.parametrize("memory", list(MemoryOrder))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_roundtrip_cuda(memory: MemoryOrder, dtype: str, seed: int) -> None:
    check_roundtrip(KVLayout(3, 2, 8, dtype, 4, memory), "cuda", seed)


def test_contiguous_runs() -> None:
    assert contiguous_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert contiguous_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]
    assert contiguous_runs([]) == []
