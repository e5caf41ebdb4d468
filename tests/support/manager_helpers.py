"""Small builders shared by the manager tests: tiny layouts, topologies and a toy engine."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tiercache import Lookup
from tiercache.blocks.paged import PagedKV
from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.manager.tier_manager import TierManager

TEST_DEVICE = os.getenv("TEST_TIERCACHE_DEVICE", "cpu")
"""The GPU tier's device in the manager tests: ``cpu`` stands in for it; ``cuda`` on a GPU machine.
(Not ``TIERCACHE_*``: the config applies those variables as overrides.)"""
TINY_LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "block_size": 2}
BLOCK = TINY_LAYOUT["block_size"]
"""Tokens per block of ``TINY_LAYOUT``."""


def topology(
    gpu_blocks: int = 6,
    cpu_blocks: int | None = 10,
    *,
    layout: dict[str, Any] | None = None,
    cpu: dict[str, Any] | None = None,
    remotes: list[dict[str, Any]] | None = None,
    **top: Any,
) -> TierCacheConfig:
    """A validated config with a CPU-device GPU pool, an optional CPU tier and remotes."""
    tiers: list[dict[str, Any]] = [
        {"type": "gpu", "capacity_blocks": gpu_blocks, "options": {"device": TEST_DEVICE}},
    ]
    if cpu_blocks is not None:
        tiers.append({"type": "cpu", "capacity_blocks": cpu_blocks, **(cpu or {})})
    tiers.extend(remotes or [])
    data = {"model": {"id": "test-model"}, "layout": layout or TINY_LAYOUT, "tiers": tiers, **top}
    return config_from_dict(data, environ={})


def block_kv(manager: TierManager, key: bytes) -> torch.Tensor:
    """The KV a toy model computes for the block with ``key``: pseudo-random, seeded by the key."""
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    values = torch.randn(manager.layout.block_shape, generator=generator, dtype=torch.float32)
    return values.to(manager.layout.torch_dtype)


def seed_remote(manager: TierManager, prompts: int, blocks: int) -> list[np.ndarray]:
    """``prompts`` distinct prompts of ``blocks`` blocks, held by the first remote only (``block_kv`` values)."""
    tier, seeded = manager.parts.remotes[0], []
    for index in range(prompts):
        tokens = np.arange(blocks * manager.block_size) + 1000 * (index + 1)
        for key in manager.hasher.keys(tokens):
            payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
            tier.store.save(key, tier.codec.encode_value(key, payload))
        seeded.append(tokens)
    return seeded


def write_block(manager: TierManager, block: int, kv: torch.Tensor) -> None:
    """Write one block's KV (in serialized order) into the pool."""
    PagedKV(manager.layout, manager.gpu.tensors).put_block(block, kv)


def read_block(manager: TierManager, block: int) -> torch.Tensor:
    """One block's KV from the pool, on the CPU, in serialized order."""
    return PagedKV(manager.layout, manager.gpu.tensors).get_block(block)


def compute_and_store(manager: TierManager, tokens: Any, wait_s: float = 10.0) -> list[int]:
    """A request with nothing cached: compute every block (the toy KV), store, release; returns its blocks."""
    keys = manager.hasher.keys(tokens)
    ids = manager.allocate(len(keys))
    for key, block in zip(keys, ids, strict=True):
        write_block(manager, block, block_kv(manager, key))
    manager.store(tokens, ids).result(wait_s)
    manager.release(ids)
    return ids


UNTIL_WAIT_S = 20.0
"""``until``'s bound on background work: a hang detector, never a speed judgement."""


def until(condition: Callable[[], Any], wait_s: float = UNTIL_WAIT_S) -> None:
    """Poll ``condition`` until it holds; fail after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


WAIT_S = 10.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def prompt(blocks: int, salt: int, head: int = 0) -> np.ndarray:
    """``blocks`` blocks of tokens; the first ``head`` blocks are shared by every salt."""
    tokens = np.arange(blocks * BLOCK) + salt * 100_000
    tokens[: head * BLOCK] = np.arange(head * BLOCK)
    return tokens


def settled(manager: TierManager, tokens: np.ndarray) -> Lookup:
    """Retry a pending lookup as a scheduler does (keeps the hit's pins: the caller releases it)."""
    hit = manager.lookup(tokens)
    deadline = time.monotonic() + WAIT_S
    while hit.pending:
        assert time.monotonic() < deadline, "the remote lookup never answered"
        time.sleep(0.001)
        hit = manager.lookup(tokens)
    return hit


def serve(manager: TierManager, tokens: np.ndarray) -> int:
    """Lookup -> allocate -> load -> check -> compute the rest -> store -> release; returns blocks reused."""
    hit = settled(manager, tokens)
    fresh = manager.allocate(len(hit.keys) - len(hit.gpu_block_ids))
    loaded = manager.load(hit, fresh[: hit.num_lower_blocks]).result(WAIT_S) // BLOCK
    table = hit.gpu_block_ids + fresh
    reused = len(hit.gpu_block_ids) + loaded
    for position, block in enumerate(table):
        expected = block_kv(manager, hit.keys[position])
        if position < reused:
            assert torch.equal(read_block(manager, block), expected), f"block {position} is wrong KV"
        else:
            write_block(manager, block, expected)
    manager.store(tokens, table).result(WAIT_S)
    manager.release(table)
    return reused
