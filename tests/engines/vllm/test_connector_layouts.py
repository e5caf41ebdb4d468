"""Every KV layout vLLM 0.33 builds, mapped as pages and round-tripped byte for byte, between layouts too.

The KV caches are vLLM's own: its planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``) and its allocator and view code
(``allocate_kv_cache`` -> ``create_kv_cache_views``) on CPU tensors, for each of
the six stride permutations of ``KVCacheLayout``, each attention backend's
supported layouts (flash-attention, Triton, the MLA backends, CPU, ...: what
``supported_kv_cache_layouts`` says), MLA's single latent head, padded pages and
kernel blocks. What is checked is independent of the page map: a slot holds
``view[block]`` in vLLM's logical order (``.contiguous()``), and a page loaded
into another layout reads back equal there, with no other byte of that cache
touched. Both transfer engines run: the CPU build's (``HostTransfers``) and the
CUDA one's staged path on CPU tensors (``StagedTransfers``).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheLayout,
    MLAAttentionSpec,
    group_kernel_blocks,
)
from vllm.v1.worker.utils import allocate_kv_cache

from tiercache.integrations.vllm.connector.geometry import SlotGeometry, instance_geometry
from tiercache.integrations.vllm.connector.pages import KVPages, page_views
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.transfers import GroupCopy, HostTransfers, Transfers

BLOCK, HEADS, HEAD_SIZE, LAYERS, BLOCKS = 16, 4, 8, 3, 48
STORED = (5, 9, 10, 2, 30)
"""vLLM blocks stored (two consecutive: one run)."""
SLOTS = (0, 1, 2, 7, 3)
LOADED = (11, 3, 4, 40, 12)
"""The blocks of another instance the same slots load into."""
BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "TRITON_FLASH_ATTN", "CPU_ATTN", "FLEX_ATTENTION", "TRITON_MLA", "FLASHMLA",
            "CPU_MLA")
"""vLLM 0.33's backends that import on this machine (FlashInfer needs its wheel: its layouts, LBNHC or LBHNC and
BLHNC on Blackwell, are among the six every test below runs)."""


def layer_names() -> list[str]:
    return [f"model.layers.{index}.self_attn.attn" for index in range(LAYERS)]


def spec_of(kind: str) -> Any:
    if kind == "mla":  # one latent head: kv_lora_rank + rope dims as content
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=3 * HEAD_SIZE, dtype=torch.float16)
    if kind == "padded":
        page = HEADS * BLOCK * 2 * HEAD_SIZE * 2
        return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                 page_size_padded=page + 256)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)


def kv_config(kind: str, layout: KVCacheLayout) -> KVCacheConfig:
    """vLLM's plan for ``LAYERS`` layers of ``kind`` and ``BLOCKS`` blocks, as its engine core makes it."""
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks = BLOCKS
    specs = {name: spec_of(kind) for name in layer_names()}
    groups = get_kv_cache_groups(config, specs)
    page = groups[0].kv_cache_spec.page_size_bytes
    return get_kv_cache_config_from_groups(config, groups, BLOCKS * page * LAYERS)


def vllm_kv(kind: str, layout: KVCacheLayout, kernel_block: int | None = None) -> tuple[KVCacheConfig, dict]:
    """vLLM's KV views for the plan, as its model runner allocates them (``allocate_kv_cache``)."""
    plan = kv_config(kind, layout)
    kernels = [kernel_block] if kernel_block is not None else None
    return plan, allocate_kv_cache(plan, torch.device("cpu"), layout, kernels)


def geometry_of(plan: KVCacheConfig) -> SlotGeometry:
    parallel = SimpleNamespace(tensor_parallel_size=1)
    geometry = instance_geometry(SimpleNamespace(parallel_config=parallel, speculative_config=None), plan).slots
    assert geometry is not None
    return geometry


def engine(name: str, pages: KVPages, geometry: SlotGeometry, region: torch.Tensor) -> Transfers:
    return HostTransfers(pages) if name == "host" else StagedTransfers(pages, geometry, 0, region)


def as_bytes(page: torch.Tensor) -> torch.Tensor:
    """A page in vLLM's logical order as bytes (random bytes make NaNs: compare bytes, not floats)."""
    return page.contiguous().view(torch.uint8)


def fill(kv: dict[str, torch.Tensor], seed: int) -> None:
    """Random bytes in every page (through vLLM's views: a padded tail stays as it was)."""
    generator = torch.Generator().manual_seed(seed)
    for view in kv.values():
        raw = view.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def store(kind: str, layout: KVCacheLayout, transfer: str, kernel_block: int | None = None):
    """Store ``STORED`` of a random cache in ``layout`` into ``SLOTS``: the cache, the region, the geometry."""
    plan, kv = vllm_kv(kind, layout, kernel_block)
    fill(kv, seed=1)
    geometry = geometry_of(plan)
    region = torch.zeros((max(SLOTS) + 1, geometry.slot_bytes), dtype=torch.uint8)
    pages = KVPages(page_views(kv, geometry, BLOCKS), geometry, 0, region)
    copies = engine(transfer, pages, geometry, region)
    copy = GroupCopy(1, 0, SLOTS, STORED)
    for layer in range(len(pages.layers)):
        assert copies.store_layer(layer, [copy]) == []
    copies.end_step([], [1])
    assert copies.poll().done == [1]
    return kv, region, geometry


def assert_slots_hold_logical_pages(kv: dict, region: torch.Tensor, geometry: SlotGeometry) -> None:
    """Each slot holds each layer's page of its block in vLLM's logical order (``[heads, tokens, content]``; kernel
    blocks grouped by vLLM's ``group_kernel_blocks``), at the geometry's offset."""
    for index, name in enumerate(layer_names()):
        page = geometry.groups[0].page_bytes
        blocks = group_kernel_blocks(kv[name], BLOCKS)
        if blocks.dim() == 5:  # [blocks, kernel blocks, heads, tokens, content]
            blocks = blocks.permute(0, 2, 1, 3, 4)
        for slot, block in zip(SLOTS, STORED, strict=True):
            start = geometry.offset(0, 0, index)
            expected = as_bytes(blocks[block]).flatten()
            assert torch.equal(region[slot, start : start + page], expected), (name, block)


def layouts_of(kind: str) -> list[KVCacheLayout]:
    """The layouts vLLM builds a cache of ``kind`` in (a padded page needs a block-compact one: vLLM asserts it)."""
    return [layout for layout in KVCacheLayout if kind != "padded" or layout.is_block_compact]


@pytest.mark.parametrize("transfer", ["host", "staged"])
@pytest.mark.parametrize(("kind", "layout"), [(kind, layout) for kind in ("full", "mla", "padded")
                                              for layout in layouts_of(kind)],
                         ids=lambda case: getattr(case, "name", case))
def test_every_layout_round_trips_into_every_other(kind: str, layout: KVCacheLayout, transfer: str) -> None:
    kv, region, geometry = store(kind, layout, transfer)
    assert_slots_hold_logical_pages(kv, region, geometry)
    for other in layouts_of(kind):
        plan, target = vllm_kv(kind, other)
        pages = KVPages(page_views(target, geometry_of(plan), BLOCKS), geometry, 0, region)
        copies = engine(transfer, pages, geometry, region)
        assert copies.load([GroupCopy(2, 0, SLOTS, LOADED)]) == []
        copies.end_step([2], [])
        assert copies.poll().done == [2]
        for name in layer_names():
            for block, loaded in zip(STORED, LOADED, strict=True):
                assert torch.equal(as_bytes(target[name][loaded]), as_bytes(kv[name][block])), (other.name, loaded)
            untouched = [b for b in range(BLOCKS) if b not in LOADED]
            assert not target[name][untouched].view(torch.uint8).count_nonzero(), "no other block was written"


RUNS = {"LBHNC": 1, "BLHNC": 1, "LHBNC": HEADS, "BHLNC": HEADS, "LBNHC": HEADS * BLOCK, "BLNHC": HEADS * BLOCK}
"""Runs of memory per page in the slot's [heads, tokens, content] order, by hand from each permutation: head-major
inside the block is one run; heads outside the block one per head; token-major one per (token, head) cell."""


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_runs_per_page_follow_the_permutation(layout: KVCacheLayout) -> None:
    plan, kv = vllm_kv("full", layout)
    pages = KVPages(page_views(kv, geometry_of(plan), BLOCKS), geometry_of(plan), 0,
                    torch.zeros((1, geometry_of(plan).slot_bytes), dtype=torch.uint8))
    assert {layer.runs for layer in pages.layers} == {RUNS[layout.name]}
    _, mla = vllm_kv("mla", layout)
    assert {len(view.shape) for view in mla.values()} == {4} and {view.shape[1] for view in mla.values()} == {1}


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=lambda layout: layout.name)
def test_kernel_blocks_leave_the_connector_vllm_s_blocks(layout: KVCacheLayout) -> None:
    """A backend splitting a block into kernel blocks (``kernel_block_sizes``): vLLM's model runner hands
    connectors views in kernel blocks, two per block here; a slot holds the whole block in the logical order."""
    for transfer in ("host", "staged"):
        kv, region, geometry = store("full", layout, transfer, kernel_block=BLOCK // 2)
        assert {view.shape[0] for view in kv.values()} == {2 * BLOCKS}
        assert_slots_hold_logical_pages(kv, region, geometry)


def backend_layouts() -> list[tuple[str, KVCacheLayout]]:
    """(backend, layout) for each layout each importable backend takes (None: every layout)."""
    cases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in BACKENDS:
            layouts = AttentionBackendEnum[name].get_class().supported_kv_cache_layouts()
            cases += [(name, layout) for layout in (layouts if layouts is not None else KVCacheLayout)]
    return cases


@pytest.mark.parametrize(("backend", "layout"), backend_layouts(), ids=lambda case: getattr(case, "name", case))
def test_each_backend_s_layouts_map_and_round_trip(backend: str, layout: KVCacheLayout) -> None:
    kind = "mla" if "MLA" in backend else "full"
    kv, region, geometry = store(kind, layout, "staged")
    assert_slots_hold_logical_pages(kv, region, geometry)
