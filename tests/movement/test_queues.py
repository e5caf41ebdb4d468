"""The transfer queue and prefetch policies, through a TierManager over a simulated remote.

Orderings are made deterministic with the simulated tier's ``hold``/``unhold``
gates instead of sleeps; ``eventually`` only bounds how long a test waits for
background work, it never judges a duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from support.manager_helpers import TINY_LAYOUT, block_kv, read_block, topology, write_block

from tiercache.manager.tier_manager import TierManager
from tiercache.movement.limiter import Priority, PriorityLimiter
from tiercache.tiers.simulated import SimulatedTier

BLOCK = TINY_LAYOUT["block_size"]
WAIT_STEP_S = 0.002
WAIT_STEPS = 5000
"""``eventually`` gives background work up to WAIT_STEP_S * WAIT_STEPS (10 s) before failing."""


async def eventually(condition: Callable[[], bool]) -> None:
    for _ in range(WAIT_STEPS):
        if condition():
            return
        await asyncio.sleep(WAIT_STEP_S)
    raise AssertionError("condition not reached")


def prompt(blocks: int, salt: int) -> np.ndarray:
    return np.arange(blocks * BLOCK) + salt * 100_000


def make_manager(
    *, gpu_blocks: int = 16, cpu_blocks: int = 32, sim: dict[str, Any] | None = None, **queues: Any
) -> TierManager:
    remote = {"type": "simulated", "name": "sim", "options": {"latency_ms": 0, **(sim or {})}}
    return TierManager(topology(gpu_blocks, cpu_blocks, remotes=[remote], queues=queues))


def sim_of(manager: TierManager) -> SimulatedTier:
    tier = manager.parts.remotes[0]
    assert isinstance(tier, SimulatedTier)
    return tier


def seed_remote(manager: TierManager, tokens: np.ndarray) -> list[bytes]:
    """Put a prompt's blocks (the toy model's KV) straight into the simulated store."""
    tier = sim_of(manager)
    keys = manager.hasher.keys(tokens)
    for key in keys:
        payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
        tier.store.save(key, tier.codec.encode_value(key, payload))
    return keys


async def settled_lookup(manager: TierManager, tokens: np.ndarray):
    hit = manager.lookup(tokens)
    for _ in range(WAIT_STEPS):
        if not hit.pending:
            return hit
        await asyncio.sleep(WAIT_STEP_S)
        hit = manager.lookup(tokens)
    raise AssertionError("lookup stayed pending")


async def start_load(manager: TierManager, tokens: np.ndarray):
    hit = await settled_lookup(manager, tokens)
    ids = manager.allocate(hit.num_lower_blocks)
    return hit, ids, manager.load(hit, ids)


def store_prompt(manager: TierManager, tokens: np.ndarray):
    keys = manager.hasher.keys(tokens)
    ids = manager.allocate(len(keys))
    for key, block in zip(keys, ids, strict=True):
        write_block(manager, block, block_kv(manager, key))
    return ids, manager.store(tokens, ids)


def assert_loaded(manager: TierManager, hit, ids: list[int], blocks: int) -> None:
    for key, block in zip(hit.keys[:blocks], ids[:blocks], strict=True):
        assert torch.equal(read_block(manager, block), block_kv(manager, key))


def no_pins(manager: TierManager) -> bool:
    tiers = manager.stats()["tiers"]
    gpu, cpu = tiers["gpu"], tiers["cpu"]
    return (
        gpu["free_blocks"] + gpu["evictable_blocks"] == gpu["capacity_blocks"]
        and cpu["evictable_blocks"] == cpu["cached_blocks"]
        and manager.stats()["queues"]["in_flight_cpu_writes"] == 0
    )


# ---- the limiter on its own ------------------------------------------------------------------
async def test_limiter_admits_loads_first_and_keeps_a_slot_for_them() -> None:
    limiter = PriorityLimiter(3)
    assert limiter.store_limit == 2
    order: list[str] = []
    release = asyncio.Event()

    async def job(name: str, priority: Priority) -> None:
        async def work() -> None:
            order.append(name)
            await release.wait()

        await limiter.run(priority, work)

    tasks = [asyncio.ensure_future(job(f"s{i}", Priority.STORE)) for i in range(4)]
    await asyncio.sleep(0)
    assert (limiter.active, limiter.active_stores) == (2, 2)
    tasks.append(asyncio.ensure_future(job("load", Priority.LOAD)))
    await asyncio.sleep(0)
    assert order == ["s0", "s1", "load"]
    release.set()
    await asyncio.gather(*tasks)
    assert order[3:] == ["s2", "s3"]
    assert (limiter.active, limiter.active_stores, limiter.waiting) == (0, 0, 0)
    assert PriorityLimiter(1).store_limit == 1


class Jobs:
    """Jobs on one limiter, each holding its slot until released by name; ``admitted`` keeps the order."""

    def __init__(self, limiter: PriorityLimiter) -> None:
        self.limiter = limiter
        self.admitted: list[str] = []
        self._release: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Future[None]] = []

    async def start(self, name: str, priority: Priority) -> None:
        release = self._release[name] = asyncio.Event()

        async def work() -> None:
            self.admitted.append(name)
            await release.wait()

        self._tasks.append(asyncio.ensure_future(self.limiter.run(priority, work)))
        await asyncio.sleep(0)

    async def release(self, name: str) -> None:
        self._release[name].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def finish(self) -> None:
        """Release every job; cancel those never admitted (the lane drops them at their deadline)."""
        for release in self._release.values():
            release.set()
        for _ in range(len(self._tasks)):
            await asyncio.sleep(0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_an_exploration_waits_behind_loads_and_stores() -> None:
    """Stores and explorations share the slots a load does not need; a waiting store goes before a waiting
    exploration, and a load never waits for either."""
    limiter = PriorityLimiter(3)
    jobs = Jobs(limiter)
    for name, priority in (("s0", Priority.STORE), ("s1", Priority.STORE), ("e0", Priority.EXPLORE),
                           ("s2", Priority.STORE), ("l0", Priority.LOAD)):
        await jobs.start(name, priority)
    assert jobs.admitted == ["s0", "s1", "l0"]
    await jobs.release("s0")
    assert jobs.admitted[3:] == ["s2"], "the store first"
    await jobs.release("l0")
    assert jobs.admitted[4:] == [], "stores and the exploration share two slots"
    await jobs.release("s1")
    assert jobs.admitted[4:] == ["e0"]
    await jobs.start("l1", Priority.LOAD)
    assert jobs.admitted[5:] == ["l1"], "the load finds its slot"
    await jobs.finish()
    assert jobs.admitted == ["s0", "s1", "l0", "s2", "e0", "l1"]
    assert (limiter.active, limiter.active_stores, limiter.active_explorations) == (0, 0, 0)


async def test_an_exploration_never_takes_the_slot_a_load_arriving_next_needs() -> None:
    """Where stores may take every slot (a limit of one or two), an exploration still leaves one free."""
    one = Jobs(PriorityLimiter(1))
    await one.start("e0", Priority.EXPLORE)
    await one.start("l0", Priority.LOAD)
    await one.release("l0")
    assert one.admitted == ["l0"], "a lane of one slot keeps it for loads, idle or not"
    await one.finish()
    assert (one.limiter.active, one.limiter.waiting) == (0, 0)
    two = Jobs(PriorityLimiter(2))
    for name, priority in (("e0", Priority.EXPLORE), ("e1", Priority.EXPLORE), ("l0", Priority.LOAD)):
        await two.start(name, priority)
    assert two.admitted == ["e0", "l0"]
    await two.release("e0")
    assert two.admitted == ["e0", "l0"], "e1 waits: the load holds one slot, the other stays free for loads"
    await two.release("l0")
    assert two.admitted == ["e0", "l0", "e1"]
    await two.finish()


# ---- through the manager ---------------------------------------------------------------------
async def test_loads_go_before_stores_under_contention() -> None:
    async with make_manager(transfer_concurrency=2) as manager:
        tier = sim_of(manager)
        tier.hold("put")
        for salt in range(4):
            ids, transfer = store_prompt(manager, prompt(2, salt))
            await transfer
            manager.release(ids)
        await eventually(lambda: manager.stats()["queues"]["waiting"]["sim"] == 3)
        assert tier.calls["put"] == 1
        wanted = prompt(3, 99)
        seed_remote(manager, wanted)
        hit, ids, load = await start_load(manager, wanted)
        assert await load == 3 * BLOCK
        assert tier.calls["put"] == 1
        assert_loaded(manager, hit, ids, 3)
        tier.unhold("put")
        await eventually(lambda: tier.calls["put"] == 4 and manager.stats()["queues"]["pending_stores"] == 0)
        kinds = [kind for kind, _ in tier.started_ops]
        assert kinds.index("get") < kinds.index("put", kinds.index("put") + 1)
        manager.release(ids)


async def test_concurrency_per_tier_is_bounded() -> None:
    async with make_manager(transfer_concurrency=3, batch_blocks=1, sim={"latency_ms": 1.0}) as manager:
        tokens = prompt(10, 1)
        seed_remote(manager, tokens)
        _, ids, load = await start_load(manager, tokens)
        assert await load == 10 * BLOCK
        tier = sim_of(manager)
        assert tier.calls["get"] == 10
        assert tier.max_in_flight == 3
        manager.release(ids)


async def test_two_requests_for_one_prefix_share_one_transfer() -> None:
    async with make_manager() as manager:
        tier = sim_of(manager)
        tokens = prompt(4, 2)
        seed_remote(manager, tokens)
        tier.hold("get")
        _, first_ids, first = await start_load(manager, tokens)
        second_hit, second_ids, second = await start_load(manager, tokens)
        assert second_hit.tier_blocks["cpu"] == 4
        tier.unhold("get")
        assert (await first, await second) == (4 * BLOCK, 4 * BLOCK)
        assert (tier.calls["get"], tier.keys_requested["get"]) == (1, 4)
        assert_loaded(manager, second_hit, second_ids, 4)
        manager.release(first_ids + second_ids)


async def test_an_aborted_request_gives_its_pins_back() -> None:
    async with make_manager(gpu_blocks=8, cpu_blocks=16) as manager:
        tier = sim_of(manager)
        tokens = prompt(4, 3)
        seed_remote(manager, tokens)
        tier.hold("get")
        _, ids, load = await start_load(manager, tokens)
        assert manager.stats()["tiers"]["gpu"]["free_blocks"] == 4
        load.cancel()
        manager.release(ids)
        assert await load == 0
        tier.unhold("get")
        await eventually(lambda: no_pins(manager))
        stats = manager.stats()["tiers"]
        assert stats["gpu"]["free_blocks"] == 8
        assert stats["cpu"]["cached_blocks"] == 4


async def test_back_pressure_drops_stores_and_never_stalls_a_load() -> None:
    async with make_manager(transfer_concurrency=2, max_pending_stores=4) as manager:
        tier = sim_of(manager)
        tier.hold("put")
        for salt in range(3):
            ids, transfer = store_prompt(manager, prompt(4, 10 + salt))
            assert await transfer == 4 * BLOCK
            manager.release(ids)
        stats = manager.stats()
        assert stats["tiers"]["sim"]["stores_dropped"] == 8
        assert stats["queues"]["pending_stores"] == 4
        wanted = prompt(2, 20)
        seed_remote(manager, wanted)
        _, ids, load = await start_load(manager, wanted)
        assert await load == 2 * BLOCK
        assert tier.calls["put"] == 1
        tier.unhold("put")
        await eventually(lambda: manager.stats()["queues"]["pending_stores"] == 0)
        manager.release(ids)


async def test_store_is_acknowledged_before_the_remote_write() -> None:
    async with make_manager() as manager:
        tier = sim_of(manager)
        tier.hold("put")
        ids, transfer = store_prompt(manager, prompt(3, 30))
        assert await transfer == 3 * BLOCK
        assert tier.stats()["entries"] == 0
        tier.unhold("put")
        await eventually(
            lambda: tier.stats()["entries"] == 3 and manager.stats()["queues"]["pending_stores"] == 0
        )
        assert manager.stats()["tiers"]["sim"]["bytes_written"] == 3 * manager.layout.bytes_per_block
        manager.release(ids)


async def test_streamed_load_hands_blocks_over_as_they_arrive() -> None:
    async with make_manager(batch_blocks=2) as manager:
        tier = sim_of(manager)
        tokens = prompt(6, 4)
        seed_remote(manager, tokens)
        tier.hold("get", allow=1)
        hit, ids, load = await start_load(manager, tokens)
        await eventually(lambda: load.progress_blocks == 2)
        assert not load.done()
        assert_loaded(manager, hit, ids, 2)
        assert [manager.gpu.table.key_of(block) for block in ids[:2]] == hit.keys[:2]
        tier.unhold("get")
        assert await load == 6 * BLOCK
        assert_loaded(manager, hit, ids, 6)
        manager.release(ids)


async def test_best_effort_settles_at_the_next_poll() -> None:
    async with make_manager(batch_blocks=2, prefetch="best_effort") as manager:
        tier = sim_of(manager)
        tokens = prompt(6, 5)
        seed_remote(manager, tokens)
        tier.hold("get", allow=1)
        hit, ids, load = await start_load(manager, tokens)
        await eventually(lambda: load.progress_blocks == 2)
        polled = manager.poll()
        assert await load == 2 * BLOCK
        await eventually(lambda: polled.extend(manager.poll()) or load in polled)
        assert_loaded(manager, hit, ids, 2)
        manager.release(ids)
        tier.unhold("get")
        await eventually(lambda: no_pins(manager))


async def test_wait_complete_ignores_polls() -> None:
    async with make_manager(prefetch="wait_complete") as manager:
        tier = sim_of(manager)
        tokens = prompt(3, 6)
        seed_remote(manager, tokens)
        tier.hold("get")
        _, ids, load = await start_load(manager, tokens)
        for _ in range(3):
            assert manager.poll() == []
            await asyncio.sleep(0)
        assert not load.done()
        tier.unhold("get")
        assert await load == 3 * BLOCK
        manager.release(ids)


async def test_timeout_gives_up_with_what_arrived() -> None:
    async with make_manager(
        prefetch="timeout", prefetch_timeout_ms=5.0, prefetch_timeout_ms_per_1k_tokens=1.0
    ) as manager:
        tier = sim_of(manager)
        tokens = prompt(3, 7)
        seed_remote(manager, tokens)
        tier.hold("get")
        _, ids, load = await start_load(manager, tokens)
        assert await load == 0
        assert manager.stats()["tiers"]["all"]["loads_cut_short"] == 1
        manager.release(ids)
        tier.unhold("get")
        await eventually(lambda: no_pins(manager))


async def test_failing_remote_is_a_miss_not_an_error() -> None:
    async with make_manager(sim={"error_rate": 1.0}) as manager:
        tokens = prompt(3, 8)
        seed_remote(manager, tokens)
        hit = await settled_lookup(manager, tokens)
        assert hit.num_blocks == 0
        sim_of(manager).options.error_rate = 0.0
        manager.parts.remotes[0].store.data.clear()
        keys = seed_remote(manager, tokens)
        sim_of(manager).corrupt(keys[1])
        hit, ids, load = await start_load(manager, prompt(3, 8))
        assert await load == 1 * BLOCK
        manager.release(ids)
