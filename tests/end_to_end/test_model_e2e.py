"""End to end with a real model: a prefix loaded from any tier continues exactly like a recomputed one.

An engine (the reference transformer in float32; the CPU stands in for the GPU
pool unless ``TEST_TIERCACHE_DEVICE=cuda``) prefills a prompt's prefix into tiercache pool blocks and stores
them. The prefix is then made to live only in the tier under test, a request
for the same prompt loads it from there, and greedy generation continues from
it. Every logit must equal, bit for bit, those of a model that recomputed the
prefix in a private pool. Both memory orders are covered. Tiers: the GPU pool,
the pinned-CPU tier, and (written by one engine, loaded by a fresh one) the
simulated remote, Redis, Redis Cluster, the file tier, and a regional store read
with ``force_latest`` from another region through central (real redis-servers).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import pytest
import torch

from tiercache.blocks.layout import KVLayout
from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.tiers.simulated import SimulatedStore
from tiercache.tools.reference_model import ModelSpec, PagedKV, ReferenceModel

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 2, 16, 4
GPU_BLOCKS, CPU_BLOCKS = 16, 64
PREFIX_BLOCKS = 5
SUFFIX_TOKENS = 3
DECODE_STEPS = 6
VOCAB = 256
LOOKUP_RETRY_S = 0.002
LOOKUP_ATTEMPTS = 2500
"""Give a pending remote lookup up to about five seconds before failing the test."""
MEMORY_ORDERS = ("block_major", "layer_major")
DEVICE = os.environ.get("TEST_TIERCACHE_DEVICE", "cpu")
"""Where the GPU pool and the model live: ``cpu`` stands in for the GPU; ``cuda`` on a GPU machine."""


def topology(memory: str, remotes: list[dict[str, Any]] | None = None) -> TierCacheConfig:
    tiers: list[dict[str, Any]] = [
        {"name": "gpu", "type": "gpu", "capacity_blocks": GPU_BLOCKS, "options": {"device": DEVICE}},
        {"name": "cpu", "type": "cpu", "capacity_blocks": CPU_BLOCKS, "write_policy": "write_through"},
    ]
    return config_from_dict(
        {
            "model": {"id": "reference-e2e"},
            "layout": {
                "num_layers": NUM_LAYERS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "float32",
                "block_size": BLOCK_SIZE,
                "memory": memory,
            },
            "tiers": tiers + (remotes or []),
        },
        environ={},
    )


def make_prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    length = PREFIX_BLOCKS * BLOCK_SIZE + SUFFIX_TOKENS
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def model_for(layout: KVLayout) -> ReferenceModel:
    return ReferenceModel(ModelSpec.for_layout(layout, heads_per_kv_head=2, vocab_size=VOCAB, seed=7), device=DEVICE)


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_SIZE)


def recompute(layout: KVLayout, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: a private pool, the prefix prefilled, then the same continuation."""
    model = model_for(layout)
    total = blocks_for(len(prompt) + DECODE_STEPS)
    kv = PagedKV(layout, layout.allocate_pool(total, DEVICE))
    table = list(range(total))
    prefix = PREFIX_BLOCKS * BLOCK_SIZE
    model.forward(prompt[:prefix], 0, table, kv)
    return model.generate(prompt, prefix, table, kv, DECODE_STEPS)


def prefill_and_store(manager: TierManager, prompt: list[int]) -> None:
    """The first request: compute the prefix into pool blocks, index and write it down, release."""
    model = model_for(manager.layout)
    prefix = PREFIX_BLOCKS * BLOCK_SIZE
    ids = manager.allocate(PREFIX_BLOCKS)
    model.forward(prompt[:prefix], 0, ids, PagedKV(manager.layout, manager.gpu.tensors))
    assert manager.store(prompt[:prefix], ids).result() == prefix
    manager.release(ids)


def continue_from_cache(
    manager: TierManager, prompt: list[int], source: str, force_latest: bool = False
) -> tuple[list[int], list[torch.Tensor]]:
    """The second request: look up, load the prefix from ``source``, generate."""
    hit = manager.lookup(prompt)
    for _ in range(LOOKUP_ATTEMPTS):
        if not hit.pending:
            break
        time.sleep(LOOKUP_RETRY_S)
        hit = manager.lookup(prompt)
    assert not hit.pending, "the remote lookup never answered"
    assert hit.tier_blocks.get(source) == PREFIX_BLOCKS, hit.tier_blocks
    held = list(hit.gpu_block_ids)
    fresh = manager.allocate(blocks_for(len(prompt) + DECODE_STEPS) - len(held))
    loaded = (
        manager.load(hit, fresh[: hit.num_lower_blocks], force_latest=force_latest).result()
        if hit.num_lower_blocks
        else 0
    )
    start = len(held) * BLOCK_SIZE + loaded
    assert start == PREFIX_BLOCKS * BLOCK_SIZE
    table = held + fresh
    result = model_for(manager.layout).generate(
        prompt, start, table, PagedKV(manager.layout, manager.gpu.tensors), DECODE_STEPS
    )
    manager.release(table)
    return result


def evict_gpu(manager: TierManager) -> None:
    """Push every cached block out of the GPU pool (they demote to the CPU tier)."""
    ids = manager.allocate(manager.gpu.num_blocks)
    manager.release(ids)


def assert_same(expected: tuple[list[int], list[torch.Tensor]], got: tuple[list[int], list[torch.Tensor]]) -> None:
    assert got[0] == expected[0]
    assert len(got[1]) == len(expected[1])
    for want, have in zip(expected[1], got[1], strict=True):
        assert torch.equal(want, have), (want - have).abs().max()


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
@pytest.mark.parametrize("source", ["gpu", "cpu"])
def test_local_tier_continues_bitwise(memory: str, source: str) -> None:
    prompt = make_prompt(seed=1)
    with TierManager(topology(memory)) as manager:
        prefill_and_store(manager, prompt)
        if source == "cpu":
            evict_gpu(manager)
        got = continue_from_cache(manager, prompt, source)
    assert_same(recompute(topology(memory).layout, prompt), got)


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
def test_paged_attention_matches_dense_pass(memory: str) -> None:
    """Sanity of the model itself: paged prefix + continuation ~= one pass over the whole prompt."""
    layout = topology(memory).layout
    prompt = make_prompt(seed=2)
    model = model_for(layout)
    total = blocks_for(len(prompt))
    split_kv = PagedKV(layout, layout.allocate_pool(total, DEVICE))
    prefix = PREFIX_BLOCKS * BLOCK_SIZE
    scrambled = list(range(total))[::-1]
    model.forward(prompt[:prefix], 0, scrambled, split_kv)
    split = model.forward(prompt[prefix:], prefix, scrambled, split_kv)
    whole_kv = PagedKV(layout, layout.allocate_pool(total, DEVICE))
    whole = model.forward(prompt, 0, list(range(total)), whole_kv)
    torch.testing.assert_close(split, whole[prefix:], rtol=1e-4, atol=1e-5)


def test_corrupted_prefix_changes_logits() -> None:
    """The comparison can fail: one flipped K element in a loaded block is visible in the logits."""
    prompt = make_prompt(seed=3)
    memory = "layer_major"
    with TierManager(topology(memory)) as manager:
        prefill_and_store(manager, prompt)
        hit = manager.lookup(prompt)
        manager.gpu.tensors[0][hit.gpu_block_ids[0], 0, 0, 0, 0] += 1.0
        manager.release(hit)
        got = continue_from_cache(manager, prompt, "gpu")
    expected = recompute(topology(memory).layout, prompt)
    assert not all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))


def continue_through_remote(
    memory: str, remote: dict[str, Any], prompt: list[int], force_latest: bool = False
) -> tuple[list[int], list[torch.Tensor]]:
    """Engine A computes and writes the prefix down; a fresh engine B (empty GPU and CPU) loads it."""
    with TierManager(topology(memory, [remote])) as first:
        prefill_and_store(first, prompt)
    with TierManager(topology(memory, [remote])) as second:
        return continue_from_cache(second, prompt, remote["name"], force_latest=force_latest)


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
def test_simulated_remote_continues_bitwise(memory: str) -> None:
    store = f"e2e-{memory}"
    SimulatedStore.forget(store)
    remote = {"name": "simulated", "type": "simulated", "options": {"store": store, "latency_ms": 0.2}}
    prompt = make_prompt(seed=4)
    try:
        got = continue_through_remote(memory, remote, prompt)
    finally:
        SimulatedStore.forget(store)
    assert_same(recompute(topology(memory).layout, prompt), got)


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
def test_redis_continues_bitwise(memory: str, redis_server: Any) -> None:
    remote = {"name": "redis", "type": "redis", "options": {"url": redis_server.url}}
    prompt = make_prompt(seed=5)
    assert_same(recompute(topology(memory).layout, prompt), continue_through_remote(memory, remote, prompt))


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
def test_redis_cluster_continues_bitwise(memory: str, redis_cluster: Any) -> None:
    remote = {"name": "cluster", "type": "redis", "options": {"url": redis_cluster.url, "cluster": True}}
    prompt = make_prompt(seed=6)
    assert_same(recompute(topology(memory).layout, prompt), continue_through_remote(memory, remote, prompt))


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
def test_file_continues_bitwise(memory: str, tmp_path: Any) -> None:
    remote = {"name": "file", "type": "file", "options": {"path": str(tmp_path / "kv"), "max_blocks": CPU_BLOCKS}}
    prompt = make_prompt(seed=7)
    assert_same(recompute(topology(memory).layout, prompt), continue_through_remote(memory, remote, prompt))


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
def test_regional_force_latest_continues_bitwise(memory: str, redis_factory: Any) -> None:
    """Engine A writes through region 1 (replicated to central); engine B in region 2 reads with force_latest."""
    central, region_one, region_two = redis_factory(), redis_factory(), redis_factory()
    prompt = make_prompt(seed=8)

    def regional(region: Any) -> dict[str, Any]:
        options = {"central_url": central.url, "region_url": region.url, "mode": "regional"}
        return {"name": "regional", "type": "regional", "options": options}

    with TierManager(topology(memory, [regional(region_one)])) as first:
        prefill_and_store(first, prompt)
    with TierManager(topology(memory, [regional(region_two)])) as second:
        got = continue_from_cache(second, prompt, "regional", force_latest=True)
    assert_same(recompute(topology(memory).layout, prompt), got)
