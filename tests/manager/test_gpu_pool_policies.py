"""Policies in the GPU pool: a GPU-only manager replaying a trace makes exactly libCacheSim's decisions.

Each trace request is a one-block prompt, served the way an engine serves it:
``lookup``, ``allocate`` with the prompt's tokens, ``load``, ``store``,
``release``. With the tokens the pool's policy sees each access before it picks a
victim (access, evict, insert: libCacheSim's order), so ARC's ghost branch and
S3-FIFO's and 2Q's ghost queues work as they do in libCacheSim's C simulator.
tests/test_policies.py checks the bare policies and the CPU tier's slot table the
same way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path

import pytest
from support.manager_helpers import TEST_DEVICE, TINY_LAYOUT
from support.policy_reference import LIBCACHESIM, cache_size, libcachesim_miss_ratio

from tiercache.config import config_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.policies.arc import ARCPolicy
from tiercache.testing.policy_traces import TRACES, Trace, oracle_traces

TRACE_LENGTH = 6_000
"""Requests per trace: every policy evicts thousands of times (a manager request costs ~0.2 ms here)."""
SIZE_FRACTION = 0.1
"""The pool's blocks as a fraction of the trace's distinct keys."""
EXACT = 1e-9


def one_block_prompt(obj_id: int) -> list[int]:
    """A prompt of exactly one block (TINY_LAYOUT's block size is 2) whose key stands for ``obj_id``."""
    return [obj_id, obj_id]


def gpu_only_manager(policy: str, blocks: int) -> TierManager:
    pool = {"type": "gpu", "capacity_blocks": blocks, "policy": policy, "options": {"device": TEST_DEVICE}}
    return TierManager(config_from_dict({"model": {"id": "pool"}, "layout": TINY_LAYOUT, "tiers": [pool]}, environ={}))


def replay(manager: TierManager, trace: Trace, *, with_tokens: bool = True) -> float:
    """Serve each request as an engine does; the pool's miss ratio."""
    misses = 0
    for obj_id in trace:
        tokens = one_block_prompt(obj_id)
        hit = manager.lookup(tokens)
        held = list(hit.gpu_block_ids)
        fresh = manager.allocate(1 - len(held), tokens) if with_tokens else manager.allocate(1 - len(held))
        manager.load(hit, [])
        manager.store(tokens, held + fresh)
        manager.release(held + fresh)
        misses += not held
    manager.gpu.table.check_invariants()
    return misses / len(trace)


def count_arc_ghost_hits(policy: object) -> Callable[[], int]:
    """Count the requests that find their key in one of ARC's ghost lists (B1, B2); a no-op for others."""
    hits = 0
    if not isinstance(policy, ARCPolicy):
        return lambda: hits
    miss = policy.miss

    def counting_miss(key: Hashable) -> None:
        nonlocal hits
        ghosts = len(policy._ghosts)
        miss(key)
        hits += len(policy._ghosts) < ghosts  # a miss only ever takes a ghost: a ghost hit

    policy.miss = counting_miss  # type: ignore[method-assign]
    return lambda: hits


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Trace, Path]]:
    """Each named trace and its oracleGeneral file."""
    return oracle_traces(tmp_path_factory.mktemp("pool-traces"), TRACE_LENGTH)


@pytest.mark.parametrize("trace_name", sorted(TRACES))
@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
def test_a_gpu_only_manager_makes_libcachesims_decisions(
    traces: dict[str, tuple[Trace, Path]], name: str, trace_name: str
) -> None:
    trace, path = traces[trace_name]
    size = cache_size(trace, SIZE_FRACTION)
    theirs = libcachesim_miss_ratio(LIBCACHESIM[name](size), path)
    assert 0.0 < theirs < 1.0
    with gpu_only_manager(name, size) as manager:
        ghost_hits = count_arc_ghost_hits(manager.gpu.table.policy)
        ours = replay(manager, trace)
    if name == "arc":
        assert ghost_hits() > 0, "ARC's ghost branch never ran"
    assert abs(ours - theirs) <= EXACT, f"{name} on {trace_name}, {size} blocks: ours {ours} libCacheSim {theirs}"


@pytest.mark.parametrize("extra", [None, "conversation-7"])
def test_the_hf_driver_admits_at_allocation_the_blocks_its_turns_store(extra: str | None) -> None:
    """The driver allocates with the same keys it looks up and stores: no block the pool admitted for a
    turn is dropped unstored (which would mean the policy saw keys the turn never had)."""
    pytest.importorskip("transformers")
    from support.hf_models import PREFIX, SUFFIX, random_tokens, tiny_model, topology

    from tiercache.integrations.transformers import CachedModel

    model = tiny_model("llama")
    prompt = random_tokens(PREFIX + SUFFIX, seed=3)
    with TierManager(topology(model)) as manager:
        policy = manager.gpu.table.policy
        dropped: list[int] = []
        remove = policy.remove

        def spying_remove(slot: int) -> None:
            dropped.append(slot)
            remove(slot)

        policy.remove = spying_remove  # type: ignore[method-assign]
        cached = CachedModel(model, manager)
        first = cached.generate(prompt[:, :PREFIX], max_new_tokens=1, extra=extra, do_sample=False)
        assert first.stored is not None and first.stored.result() == PREFIX
        second = cached.generate(prompt, max_new_tokens=2, extra=extra, do_sample=False)
        assert second.cached_tokens == PREFIX and second.stored is not None
        second.stored.result()
        manager.gpu.table.check_invariants()
    assert dropped == []
