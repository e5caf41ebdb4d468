"""TierManager against a reference model: capacities, pins, exact bytes, ref counts."""

from __future__ import annotations

import asyncio
import random

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.manager_helpers import TINY_LAYOUT, block_kv, read_block, topology, write_block

from tiercache.bookkeeping.slots import CapacityError
from tiercache.manager.tier_manager import TierManager
from tiercache.policies import POLICIES

BLOCK = TINY_LAYOUT["block_size"]


def prompt_family(seed: int, count: int, max_blocks: int) -> list[np.ndarray]:
    """Prompts that share prefixes: random walks down a small token tree."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        blocks = rng.randint(1, max_blocks)
        tokens = [rng.choice((1, 2)) * 10 + position for position in range(blocks * BLOCK)]
        prompts.append(np.array(tokens + [99] * rng.randint(0, BLOCK - 1)))
    return prompts


class Engine:
    """The engine side of the contract, with exact checks of every block it reads."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self.mismatches = 0

    def begin(self, tokens: np.ndarray) -> tuple[list[int], int]:
        """Serve a request up to its stored prefix; return its held blocks and reused tokens."""
        manager = self.manager
        hit = manager.lookup(tokens)
        assert not hit.pending
        held = list(hit.gpu_block_ids)
        try:
            fresh = manager.allocate(len(hit.keys) - len(held))
        except CapacityError:
            manager.release(hit)
            raise
        loaded = manager.load(hit, fresh[: hit.num_lower_blocks]).result(10) // BLOCK
        ready = held + fresh[:loaded]
        for position, block in enumerate(ready):
            if not torch.equal(read_block(manager, block), block_kv(manager, hit.keys[position])):
                self.mismatches += 1
        for position in range(len(ready), len(hit.keys)):
            write_block(manager, fresh[position - len(held)], block_kv(manager, hit.keys[position]))
        manager.store(tokens, held + fresh).result(10)
        return held + fresh, len(ready) * BLOCK


class ManagerMachine(RuleBasedStateMachine):
    """Random requests start and finish; the manager must keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.gpu_blocks, self.cpu_blocks = 6, 10
        self.manager = TierManager(topology(self.gpu_blocks, self.cpu_blocks))
        self.manager.start_blocking()
        self.engine = Engine(self.manager)
        self.prompts = prompt_family(seed=7, count=12, max_blocks=5)
        self.active: list[list[int]] = []

    @rule(index=st.integers(0, 11))
    def start_request(self, index: int) -> None:
        gpu = self.manager.gpu.table
        before = (gpu.num_free, gpu.num_evictable, gpu.num_cached)
        try:
            blocks, _ = self.engine.begin(self.prompts[index])
        except CapacityError:
            assert (gpu.num_free, gpu.num_evictable, gpu.num_cached) == before, "a failed allocate changed state"
            return
        self.active.append(blocks)

    @rule(index=st.integers(0, 11), release=st.booleans())
    def lookup_never_loaded(self, index: int, release: bool) -> None:
        """A scheduler looks a prompt up and gives up on it: released, or simply dropped."""
        hit = self.manager.lookup(self.prompts[index])
        assert not hit.pending
        if release:
            self.manager.release(hit)
        else:
            self.manager.release(hit.gpu_block_ids)
            del hit  # a hit holds no reference cycle: dropping it returns its pins without waiting for gc

    @rule(index=st.integers(0, 11), retries=st.integers(1, 3))
    def retried_lookup_then_request(self, index: int, retries: int) -> None:
        """Lookups retried (as while a remote answer is pending) before the request is served."""
        for _ in range(retries):
            self.manager.release(self.manager.lookup(self.prompts[index]))
        self.start_request(index)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        blocks = self.active.pop(data.draw(st.integers(0, len(self.active) - 1)))
        self.manager.release(blocks)

    @invariant()
    def bookkeeping_holds(self) -> None:
        manager = self.manager
        manager.poll()  # lets go of the pins of lookups dropped unused
        assert self.engine.mismatches == 0
        manager.gpu.table.check_invariants()
        manager.parts.cpu.table.check_invariants()
        assert manager.gpu.table.num_cached <= self.gpu_blocks
        assert manager.parts.cpu.table.num_cached <= self.cpu_blocks
        pins: dict[int, int] = {}
        for blocks in self.active:
            for block in blocks:
                pins[block] = pins.get(block, 0) + 1
        for block in range(self.gpu_blocks):
            assert manager.gpu.table.ref(block) == pins.get(block, 0), f"block {block} ref count drifted"
        for slot in range(self.cpu_blocks):
            assert manager.parts.cpu.table.ref(slot) == 0, "a CPU slot stayed pinned after its transfer"

    def teardown(self) -> None:
        for blocks in self.active:
            self.manager.release(blocks)
        for block in range(self.gpu_blocks):
            assert self.manager.gpu.table.ref(block) == 0
        self.manager.close_blocking()


ManagerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerMachine = ManagerMachine.TestCase


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("memory", ["block_major", "layer_major"])
@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("cpu_write", ["write_through", "write_back", "write_through_selective"])
def test_scheduler_simulation_with_overlapping_prefixes(
    policy: str, memory: str, exclusive: bool, cpu_write: str
) -> None:
    """Many requests in flight at once, sharing system prompts; every reused block is exact."""
    config = topology(
        12,
        40,
        layout={**TINY_LAYOUT, "memory": memory},
        cpu={"write_policy": cpu_write, "policy": policy},
        exclusive=exclusive,
    )
    config.tiers[0].policy = policy
    rng = random.Random(3)
    systems = [[rng.randrange(1000) for _ in range(4 * BLOCK)] for _ in range(3)]
    with TierManager(config) as manager:
        engine = Engine(manager)
        running: list[tuple[list[int], int]] = []
        reused = 0
        for step in range(300):
            if running and (len(running) >= 3 or rng.random() < 0.4):
                blocks, _ = running.pop(rng.randrange(len(running)))
                manager.release(blocks)
            tokens = systems[step % 3] + [rng.randrange(4) for _ in range(rng.randint(0, 3 * BLOCK))]
            try:
                blocks, hit_tokens = engine.begin(np.array(tokens))
            except CapacityError:
                continue
            reused += hit_tokens
            running.append((blocks, step))
            manager.poll()
        for blocks, _ in running:
            manager.release(blocks)
        manager.gpu.table.check_invariants()
        manager.parts.cpu.table.check_invariants()
        assert engine.mismatches == 0
        assert reused > 0, "shared system prompts must be reused"
        assert all(manager.gpu.table.ref(b) == 0 for b in range(12))
        stats = manager.stats()["tiers"]
        if cpu_write != "write_through_selective":
            assert stats["cpu"]["blocks_out"] > 0, "the CPU tier should have served some loads"


def test_allocate_fails_as_a_whole_when_blocks_are_pinned() -> None:
    with TierManager(topology(4, 4)) as manager:
        held = manager.allocate(3)
        with pytest.raises(CapacityError, match="need 2 slots: 1 free and 0 evictable"):
            manager.allocate(2)
        assert manager.gpu.table.num_free == 1
        manager.release(held)
        assert len(manager.allocate(4)) == 4


def test_store_rejects_blocks_it_does_not_own() -> None:
    with TierManager(topology(4, 4)) as manager:
        tokens = np.arange(2 * BLOCK)
        with pytest.raises(ValueError, match="not held"):
            manager.store(tokens, [0, 1])
        ids = manager.allocate(2)
        manager.store(tokens, ids).result(5)
        with pytest.raises(ValueError, match="another prefix"):
            manager.store(np.arange(2 * BLOCK) + 100, ids)
        manager.release(ids)


def test_load_without_lower_copies_loads_nothing() -> None:
    with TierManager(topology(4, None)) as manager:
        hit = manager.lookup(np.arange(3 * BLOCK))
        assert hit.num_blocks == 0 and not hit.pending
        assert manager.load(hit, manager.allocate(3)).result(5) == 0


async def test_asyncio_engine_awaits_transfers() -> None:
    """A client written only against docs/architecture.md, "The contract with the engine", on an asyncio
    scheduler."""
    async with TierManager(topology(4, 16)) as manager:
        tokens = np.arange(4 * BLOCK)
        hit = manager.lookup(tokens)
        ids = manager.allocate(len(hit.keys))
        originals = [torch.randn(manager.layout.block_shape) for _ in ids]
        for block, kv in zip(ids, originals, strict=True):
            write_block(manager, block, kv)
        assert await manager.store(tokens, ids) == 4 * BLOCK
        manager.release(ids)
        manager.release(manager.allocate(4))
        hit = manager.lookup(tokens)
        assert hit.tier_blocks == {"gpu": 0, "cpu": 4}
        fresh = manager.allocate(4)
        assert await manager.load(hit, fresh) == 4 * BLOCK
        for block, kv in zip(fresh, originals, strict=True):
            assert torch.equal(read_block(manager, block), kv)
        manager.release(fresh)
        done = manager.poll()
        assert [t.kind.value for t in done].count("load") == 1
        await asyncio.sleep(0)


def test_calls_before_start_or_after_close_are_refused() -> None:
    manager = TierManager(topology(4, 4))
    tokens = np.arange(2 * BLOCK)
    with pytest.raises(RuntimeError, match="not started"):
        manager.lookup(tokens)
    manager.start_blocking()
    ids = manager.allocate(2)
    manager.store(tokens, ids).result(5)
    manager.release(ids)
    manager.close_blocking()
    with pytest.raises(RuntimeError, match="closed"):
        manager.store(tokens, ids)


def test_engine_supplied_pool_and_path_constructor(tmp_path) -> None:
    """An engine may hand its own paged KV tensors over; ``mgr.gpu[i]`` is a pool tensor."""
    config = topology(4, 8, layout={**TINY_LAYOUT, "memory": "layer_major"})
    pool = config.layout.allocate_pool(5, "cpu")
    with TierManager(config, gpu_tensors=pool) as manager:
        assert manager.gpu.num_blocks == 5 and len(manager.gpu) == TINY_LAYOUT["num_layers"]
        assert all(a is b for a, b in zip(manager.gpu, pool, strict=True)) and manager.gpu[1] is pool[1]
        ids = manager.allocate(2)
        kv = torch.randn(manager.layout.block_shape)
        write_block(manager, ids[1], kv)
        assert torch.equal(pool[1][ids[1]], kv[1]), "the manager must work on the engine's tensors"
        manager.release(ids)
    with pytest.raises(ValueError, match="dtype"):
        TierManager(config, gpu_tensors=[t.half() for t in pool])
    path = tmp_path / "t.yaml"
    path.write_text("model: {id: m}\nlayout: {num_layers: 1, num_kv_heads: 1, head_dim: 2}\n"
                    "tiers: [{type: gpu, capacity_blocks: 2, options: {device: cpu}}]\n")
    assert TierManager(str(path)).gpu.num_blocks == 2
