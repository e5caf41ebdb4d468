"""Loads whose blocks are all resident (CPU tier, or GPU blocks later in the prefix): copied from the caller's
thread with no hop to the background loop; a batch's pairs made into runs whatever their order; the CPU tier's
memory paged in when it is built.

On the CPU device a small one has landed when ``load`` returns; a large one goes
through the copy thread. Either way the bytes are the engine's, the pins go, and
the promoted blocks are indexed in the pool.
"""

from __future__ import annotations

import ctypes
import os

import torch
from support.manager_helpers import (
    BLOCK,
    TEST_DEVICE,
    WAIT_S,
    block_kv,
    compute_and_store,
    prompt,
    read_block,
    topology,
)

from tiercache.blocks.layout import PageLayout
from tiercache.manager.tier_manager import TierManager
from tiercache.movement.swap import paired_runs
from tiercache.policies import make_policy
from tiercache.tiers.cpu import CpuOptions, CpuTier

BIG_LAYOUT = {"num_layers": 64, "num_kv_heads": 8, "head_dim": 128, "dtype": "float32", "block_size": 16}
"""8 MiB a block: past what the CPU device copies on the caller's thread."""
PAGE_IN_SLOTS = 32
"""A CPU tier of 32 MiB (1 MiB slots)."""
PAGED_IN_SHARE = 0.9
"""Of the tier's bytes, what must be resident after it is built (the rest: the allocator's slack)."""


def evict_from_pool(manager: TierManager, tokens: object) -> None:
    """Take every pool block once (evicting the prompt's blocks from the pool; the CPU tier keeps them)."""
    ids = manager.allocate(manager.gpu.num_blocks)
    manager.release(ids)
    hit = manager.lookup(tokens)
    assert hit.gpu_block_ids == [], "the prompt is still in the pool"
    manager.release(hit)


def test_a_cpu_hit_is_copied_into_its_blocks_and_indexed_there() -> None:
    with TierManager(topology(gpu_blocks=4, cpu_blocks=8)) as manager:
        tokens = prompt(3, salt=1)
        compute_and_store(manager, tokens)
        evict_from_pool(manager, tokens)
        hit = manager.lookup(tokens)
        assert hit.tier_blocks["cpu"] == 3
        ids = manager.allocate(3)
        transfer = manager.load(hit, ids)
        if TEST_DEVICE == "cpu":
            assert transfer.done(), "a small CPU-tier hit on the CPU device lands before load returns"
        assert transfer.result(WAIT_S) == 3 * BLOCK
        assert transfer in manager.poll()
        for key, block in zip(hit.keys, ids, strict=True):
            assert torch.equal(read_block(manager, block), block_kv(manager, key))
        assert unpinned(manager.parts.cpu.table.occupancy()), "the load's CPU pins are dropped"
        manager.store(tokens, ids).result(WAIT_S)
        manager.release(ids)
        again = manager.lookup(tokens)
        assert again.gpu_block_ids == ids, "the promoted blocks are indexed in the pool"
        manager.release(again)


def test_gpu_blocks_later_in_the_prefix_are_copied_on_the_device_with_the_cpu_ones() -> None:
    with TierManager(topology(gpu_blocks=6, cpu_blocks=8)) as manager:
        tokens = prompt(3, salt=2)
        compute_and_store(manager, tokens)
        keys = manager.hasher.keys(tokens)
        assert manager.parts.gpu.table.discard(keys[0]), "the head leaves the pool, the CPU tier keeps it"
        hit = manager.lookup(tokens)
        assert hit.gpu_block_ids == [] and hit.tiers == ["cpu", "gpu", "gpu"]
        ids = manager.allocate(3)
        assert manager.load(hit, ids).result(WAIT_S) == 3 * BLOCK
        for key, block in zip(keys, ids, strict=True):
            assert torch.equal(read_block(manager, block), block_kv(manager, key))
        manager.release(ids)
        assert unpinned(manager.parts.gpu.table.occupancy()), "the resident blocks' pins are dropped"


def test_a_resident_load_too_large_to_copy_at_once_lands_through_the_copy_thread() -> None:
    with TierManager(topology(gpu_blocks=2, cpu_blocks=4, layout=BIG_LAYOUT)) as manager:
        tokens = list(range(BIG_LAYOUT["block_size"]))
        compute_and_store(manager, tokens)
        evict_from_pool(manager, tokens)
        assert not manager.parts.swap.copies_now(1)
        hit = manager.lookup(tokens)
        ids = manager.allocate(1)
        assert manager.load(hit, ids).result(WAIT_S) == BIG_LAYOUT["block_size"]
        assert torch.equal(read_block(manager, ids[0]), block_kv(manager, hit.keys[0]))
        manager.release(ids)


def test_pairs_descending_on_both_sides_make_one_run() -> None:
    assert paired_runs([3, 2, 1, 0], [11, 10, 9, 8]) == [(0, 8, 4)]
    assert paired_runs([5, 1, 2], [0, 7, 8]) == [(1, 7, 2), (5, 0, 1)]
    assert paired_runs([2, 1], [0, 1]) == [(1, 1, 1), (2, 0, 1)], "one side descending, the other not: no run"
    assert paired_runs([], []) == []


def test_a_cpu_tier_it_allocates_is_resident_from_the_start() -> None:
    """The tier's own pages are resident once it is built (``mincore``), its allocation a fresh mapping: glibc's
    mmap threshold is fixed first, so an earlier test's freed memory cannot stand in for pages the tier touched."""
    fresh_mappings_for_large_allocations()
    layout = PageLayout(block_bytes=1 << 20, block_size=16)
    tier = CpuTier("cpu", layout, PAGE_IN_SLOTS, make_policy("lru", PAGE_IN_SLOTS), CpuOptions(pin_memory=False))
    share = resident_share(tier.buffer)
    assert share >= PAGED_IN_SHARE, f"only {share:.0%} of the tier's {tier.capacity_bytes} bytes were paged in"
    assert int(tier.buffer.count_nonzero()) == 0


def unpinned(occupancy: dict[str, int]) -> bool:
    """Every cached entry of a tier is evictable: nothing pins it."""
    return occupancy["cached_blocks"] == occupancy["evictable_blocks"]


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter; set, it also stops glibc raising the threshold after a large free."""


def fresh_mappings_for_large_allocations() -> None:
    """Allocations of 128 KiB and more get their own new mapping (glibc's default before it adapts the threshold)."""
    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1


def resident_share(tensor: torch.Tensor) -> float:
    """The share of ``tensor``'s memory pages resident now (Linux ``mincore``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (ctypes.c_ubyte * -(-length // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, pages) == 0, os.strerror(ctypes.get_errno())
    return sum(entry & 1 for entry in pages) / len(pages)
