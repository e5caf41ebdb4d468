"""A toy engine that drives a TierManager the way a scheduler does, and checks every byte.

The "model" computes each block's KV as a pseudo-random tensor seeded by the
block's key, so any block loaded from any tier can be compared with what
recomputing it would give.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from tiercache.blocks.paged import PagedKV
from tiercache.manager.tier_manager import CapacityError, TierManager
from tiercache.tools.workload import ChatWorkload

ALLOCATE_RETRY_SECONDS = 0.001
"""Pause between allocation attempts while the GPU pool is full of pinned blocks."""


def block_kv(manager: TierManager, key: bytes) -> torch.Tensor:
    """The KV the toy model computes for the block with ``key`` (deterministic)."""
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    layout = manager.layout
    values = torch.randn(layout.block_shape, generator=generator, dtype=torch.float32)
    return values.to(layout.torch_dtype)


def write_block(manager: TierManager, block: int, kv: torch.Tensor) -> None:
    """Write one block's KV (in serialized order) into the pool."""
    PagedKV(manager.layout, manager.gpu.tensors).put_block(block, kv)


def read_block(manager: TierManager, block: int) -> torch.Tensor:
    """One block's KV from the pool, on the CPU, in serialized order."""
    return PagedKV(manager.layout, manager.gpu.tensors).get_block(block)


@dataclass
class RunReport:
    """What a workload run reused, computed and moved."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: Counter[str] = field(default_factory=Counter)
    computed_tokens: int = 0
    mismatched_blocks: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Served:
    """One request: tokens reused per tier, tokens computed, seconds its load took, blocks that were wrong."""

    reused: dict[str, int]
    computed_tokens: int
    load_seconds: float
    mismatched_blocks: int


def _allocate(manager: TierManager, count: int, tokens: np.ndarray, attempts: int) -> list[int]:
    """A full pool may be waiting for write-through copies to unpin blocks: retry a while."""
    for attempt in range(attempts):
        try:
            return manager.allocate(count, tokens)
        except CapacityError:
            if attempt == attempts - 1:
                raise
            time.sleep(ALLOCATE_RETRY_SECONDS)
    raise ValueError(f"attempts must be >= 1, got {attempts}")


def serve(manager: TierManager, tokens: np.ndarray, allocate_attempts: int = 1) -> Served:
    """One request as an engine serves it: look up, load, check, compute the rest, store, release.

    Raises ``CapacityError`` (holding nothing) when the GPU pool has no room after
    ``allocate_attempts`` tries.
    """
    block_size = manager.block_size
    hit = manager.lookup_wait(tokens)
    held = list(hit.gpu_block_ids)
    try:
        fresh = _allocate(manager, len(hit.keys) - len(held), tokens, allocate_attempts)
    except CapacityError:
        manager.release(hit)
        raise
    loaded_blocks, load_seconds = 0, 0.0
    if hit.num_lower_blocks:
        started = time.perf_counter()
        loaded_blocks = manager.load(hit, fresh[: hit.num_lower_blocks]).result() // block_size
        load_seconds = time.perf_counter() - started
    else:
        manager.load(hit, [])
    reused: dict[str, int] = {}
    for tier in hit.tiers[: len(held) + loaded_blocks]:
        reused[tier] = reused.get(tier, 0) + block_size
    mismatched = 0
    for position, block in enumerate(held + fresh[:loaded_blocks]):
        if not torch.equal(read_block(manager, block), block_kv(manager, hit.keys[position])):
            mismatched += 1
    for offset, block in enumerate(fresh[loaded_blocks:]):
        write_block(manager, block, block_kv(manager, hit.keys[len(held) + loaded_blocks + offset]))
    manager.store(tokens, held + fresh)
    manager.release(held + fresh)
    computed = len(tokens) - (len(held) + loaded_blocks) * block_size
    return Served(reused, computed, load_seconds, mismatched)


def run_workload(manager: TierManager, workload: ChatWorkload) -> RunReport:
    report = RunReport()
    started = time.perf_counter()
    for _, tokens in workload.requests():
        served = serve(manager, tokens)
        report.requests += 1
        report.prompt_tokens += len(tokens)
        report.reused_tokens.update(served.reused)
        report.computed_tokens += served.computed_tokens
        report.mismatched_blocks += served.mismatched_blocks
        manager.poll()
    report.seconds = time.perf_counter() - started
    return report


def format_report(manager: TierManager, report: RunReport) -> str:
    stats = manager.stats()
    lines = [
        f"requests: {report.requests}   prompt tokens: {report.prompt_tokens}   "
        f"computed (prefill) tokens: {report.computed_tokens}   time: {report.seconds:.2f}s",
        f"{'tier':<10}{'tokens reused':>15}{'share':>8}{'cached blocks':>15}{'moved in (MiB)':>16}"
        f"{'moved out (MiB)':>17}",
    ]
    block_mib = manager.layout.bytes_per_block / 2**20
    for name, tier in stats["tiers"].items():
        if name == "all":
            continue
        reused = report.reused_tokens.get(name, 0)
        moved_in = tier.get("blocks_in", 0) * block_mib
        moved_out = tier.get("blocks_out", 0) * block_mib
        lines.append(
            f"{name:<10}{reused:>15}{reused / max(report.prompt_tokens, 1):>8.1%}"
            f"{tier.get('cached_blocks', '-'):>15}{moved_in:>16.1f}{moved_out:>17.1f}"
        )
    total_reused = sum(report.reused_tokens.values())
    verdict = "OK" if report.mismatched_blocks == 0 else f"{report.mismatched_blocks} MISMATCHED blocks"
    lines.append(
        f"reused {total_reused} of {report.prompt_tokens} prompt tokens "
        f"({total_reused / max(report.prompt_tokens, 1):.1%}); KV verified against recompute: {verdict}"
    )
    return "\n".join(lines)
