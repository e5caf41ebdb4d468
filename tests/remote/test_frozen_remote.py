"""A frozen remote (a SIGSTOPped redis-server): the lane's deadline bounds what the engine sees.

The socket timeout is set far beyond the deadlines, so a lookup or a load that
waited for the socket would still be waiting when the test gives up on it: each
answer must arrive while the tier's own call is still blocked (counted as a late
call in flight). The late read keeps its CPU staging slots reserved until it really ends,
so nothing stored meanwhile can be overwritten when the frozen server's replies
finally land; after SIGCONT the lane recovers by itself.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np
import torch
from support.manager_helpers import TINY_LAYOUT, block_kv, compute_and_store, read_block, topology, until
from support.sync_sites import eventually, holds

from tiercache.manager.tier_manager import TierManager
from tiercache.movement.lanes import Lane
from tiercache.telemetry.counters import Metrics
from tiercache.testing.redis_servers import random_blocks, remote_context
from tiercache.tiers.base import Presence
from tiercache.tiers.redis import RedisOptions, RedisTier

SOCKET_TIMEOUT_S = 60.0
"""Far beyond every deadline below: a call that waits for the socket is still waiting at ``ANSWER_BY_S``."""
ANSWER_BY_S = SOCKET_TIMEOUT_S / 2
"""A lookup or load not answered by then waited for the socket instead of its deadline (a hang detector)."""
LOOKUP_DEADLINE_MS = 50.0
PROMPT_BLOCKS = 4
CPU_BLOCKS = 16
GPU_BLOCKS = 8
STORED_WHILE_FROZEN = 3
"""Prompts stored while the late read holds its slots: they fill every other CPU slot."""
WAIT_S = 30.0
"""A hang detector for background work, never a speed judgement."""
LOOKUP_POLL_S = 0.005
BLOCK = TINY_LAYOUT["block_size"]
BLOCK_BYTES = 4096


def config(url: str, cpu_blocks: int = CPU_BLOCKS) -> Any:
    remote = {
        "name": "redis",
        "type": "redis",
        "write_policy": "write_through",
        "options": {"url": url, "allow_unbounded": True, "timeout_s": SOCKET_TIMEOUT_S},
    }
    return topology(GPU_BLOCKS, cpu_blocks, remotes=[remote], queues={"remote_lookup_timeout_ms": LOOKUP_DEADLINE_MS})


def prompt(index: int) -> np.ndarray:
    return np.arange(PROMPT_BLOCKS * BLOCK) + 10_000 * index


def answered(manager: TierManager, tokens: np.ndarray) -> Any:
    """The first lookup of ``tokens`` that is not pending (polled as a scheduler would)."""
    deadline = time.monotonic() + ANSWER_BY_S
    while (hit := manager.lookup(tokens)).pending:
        assert time.monotonic() < deadline, "a lookup waited for the socket, not its deadline"
        time.sleep(LOOKUP_POLL_S)
    return hit


def loads_right(manager: TierManager, tokens: np.ndarray) -> bool:
    """Whether the whole prompt is cached and comes back into the GPU pool with the KV it was stored with."""
    hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
    run = list(hit.gpu_block_ids)
    if hit.num_blocks != PROMPT_BLOCKS:
        manager.release(hit)
        manager.release(run)
        return False
    ids = manager.allocate(PROMPT_BLOCKS - len(run))
    loaded = manager.load(hit, ids).result(WAIT_S) // BLOCK
    blocks = run + ids[:loaded]
    keys = manager.hasher.keys(tokens)
    right = len(blocks) == PROMPT_BLOCKS and all(
        torch.equal(read_block(manager, block), block_kv(manager, key)) for block, key in zip(blocks, keys, strict=True)
    )
    manager.release(run + ids)
    return right


def test_a_frozen_server_holds_neither_lookups_nor_loads_and_late_reads_keep_their_slots(redis_server: Any) -> None:
    with TierManager(config(redis_server.url, cpu_blocks=64)) as writer:
        for index in range(8):
            compute_and_store(writer, prompt(index))
        until(lambda: int(redis_server.cli("DBSIZE")) == 8 * PROMPT_BLOCKS, WAIT_S)
    with TierManager(config(redis_server.url)) as manager:
        hit = manager.lookup_wait(prompt(0), timeout_s=WAIT_S)
        assert hit.tier_blocks["redis"] == PROMPT_BLOCKS
        redis_server.stop()
        try:
            ids = manager.allocate(PROMPT_BLOCKS)
            load = manager.load(hit, ids)
            try:
                assert load.result(ANSWER_BY_S) == 0
            except concurrent.futures.TimeoutError:
                raise AssertionError("the load waited for the socket, not its deadline") from None
            assert manager.stats()["tiers"]["redis"]["late_calls_in_flight"] == 1
            manager.release(ids)
            cpu = manager.stats()["tiers"]["cpu"]
            assert cpu["free_blocks"] == CPU_BLOCKS - PROMPT_BLOCKS, "the late read's staging slots stay reserved"

            for index in range(1, 5):
                frozen = answered(manager, prompt(index))
                assert frozen.tier_blocks["redis"] == 0
                manager.release(frozen)
            lane = manager.stats()["tiers"]["redis"]
            assert lane["deadline_misses"] >= 3 and lane["lane_breaker_opened"] >= 1

            stored = [prompt(100 + index) for index in range(STORED_WHILE_FROZEN)]
            for tokens in stored:
                compute_and_store(manager, tokens)
            assert manager.stats()["tiers"]["cpu"]["free_blocks"] == 0
        finally:
            redis_server.cont()
        until(lambda: manager.stats()["tiers"]["redis"]["late_calls_in_flight"] == 0, WAIT_S)
        assert manager.stats()["tiers"]["cpu"]["free_blocks"] == PROMPT_BLOCKS, "the late slots are free again"
        for tokens in stored:
            assert loads_right(manager, tokens), "a late read wrote into a slot that was reused"
        until(lambda: loads_right(manager, prompt(0)), WAIT_S)


async def test_a_call_still_waiting_for_a_slot_at_its_deadline_never_reaches_the_tier(redis_server: Any) -> None:
    """Behind a late call holding the lane's only slot, the next call is dropped at its deadline, not queued
    to reach the frozen server later."""
    tier = RedisTier(remote_context(BLOCK_BYTES), RedisOptions(url=redis_server.url, timeout_s=SOCKET_TIMEOUT_S))
    await tier.start()
    metrics = Metrics()
    lane = Lane(0, tier, 1, metrics, LOOKUP_DEADLINE_MS / 1000)
    counters = metrics.counters[tier.name]
    keys, _ = random_blocks(4, BLOCK_BYTES)
    redis_server.stop()
    try:
        for _ in range(2):
            assert await lane.contains(keys) == [Presence.UNKNOWN] * len(keys)
        assert counters["deadline_misses"] == 2
        assert counters["late_calls_in_flight"] == 1, "only the first call reached the tier"
    finally:
        redis_server.cont()
    await eventually(lambda: holds(counters["late_calls_in_flight"] == 0))
    answered = sum(count for name, count in tier.stats().items() if name.startswith("contains_"))
    assert answered == len(keys), "the dropped call never sent its EXISTS"
    await tier.close()
