"""Calls an engine gets wrong: block ids that are duplicated, out of range or not its own, and calls after close.

Each bad call is refused with a clear error before anything changes; every call
after ``close`` either works or raises the documented ``RuntimeError``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from support.manager_helpers import TINY_LAYOUT, compute_and_store, topology

from tiercache.manager.tier_manager import CapacityError, TierManager

BLOCK = TINY_LAYOUT["block_size"]
WAIT_S = 10.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def gpu_state(manager: TierManager) -> tuple[list[int], list[bytes | None]]:
    """Every GPU block's ref count and key: what a refused call must leave as it was."""
    table = manager.gpu.table
    blocks = range(table.num_slots)
    return [table.ref(block) for block in blocks], [table.key_of(block) for block in blocks]


def test_store_refuses_duplicate_ids_and_changes_nothing() -> None:
    with TierManager(topology(6, 10)) as manager:
        tokens = np.arange(2 * BLOCK)
        ids = manager.allocate(2)
        before = gpu_state(manager)
        with pytest.raises(ValueError, match="duplicate"):
            manager.store(tokens, [ids[0], ids[0]])
        assert gpu_state(manager) == before
        manager.release(ids)
        manager.release(manager.allocate(6))  # no block leaked
        manager.gpu.table.check_invariants()


@pytest.mark.parametrize("bad", [-1, 6, 10**9])
def test_every_call_taking_ids_refuses_ids_out_of_range(bad: int) -> None:
    with TierManager(topology(6, 10)) as manager:
        tokens = np.arange(2 * BLOCK)
        ids = manager.allocate(2)
        hit = manager.lookup(tokens)
        before = gpu_state(manager)
        for call in (
            lambda: manager.release([bad]),
            lambda: manager.store(tokens, [ids[0], bad]),
            lambda: manager.load(hit, [bad]),
        ):
            with pytest.raises(ValueError, match="out of range"):
                call()
            assert gpu_state(manager) == before


def test_release_of_a_block_it_does_not_hold_cannot_unpin_another_requests_block() -> None:
    with TierManager(topology(4, 8)) as manager:
        theirs = manager.allocate(4)  # another request holds the whole pool
        with pytest.raises(ValueError, match="out of range"):
            manager.release([-1])
        with pytest.raises(CapacityError):
            manager.allocate(1)  # nothing was freed: never [-1], never their block
        manager.release(theirs[:1])
        with pytest.raises(ValueError, match="not held"):
            manager.release(theirs[:1])  # released already
        assert manager.allocate(1) == theirs[:1]


def test_release_refuses_a_duplicated_id_before_unpinning_any() -> None:
    with TierManager(topology(4, 8)) as manager:
        ids = manager.allocate(2)
        before = gpu_state(manager)
        with pytest.raises(ValueError, match="duplicate"):
            manager.release([ids[1], ids[0], ids[1]])
        assert gpu_state(manager) == before
        manager.release(ids)
        assert manager.stats()["tiers"]["gpu"]["free_blocks"] == 4


def test_store_and_load_refuse_blocks_the_caller_does_not_hold() -> None:
    with TierManager(topology(6, 10, cpu={"write_policy": "write_through"})) as manager:
        tokens = np.arange(3 * BLOCK)
        cached = compute_and_store(manager, tokens)  # stored, then released: cached, held by nobody
        before = gpu_state(manager)
        with pytest.raises(ValueError, match="not held"):
            manager.store(tokens, cached)
        assert gpu_state(manager) == before
        manager.release(manager.allocate(6))  # the blocks move down to the CPU tier
        hit = manager.lookup(tokens)
        assert hit.num_lower_blocks == 3
        fresh = manager.allocate(3)
        manager.release(fresh[2:])
        before = gpu_state(manager)
        with pytest.raises(ValueError, match="not held"):
            manager.load(hit, fresh)  # its last block went back to the pool
        with pytest.raises(ValueError, match="duplicate"):
            manager.load(hit, [fresh[0], fresh[0], fresh[1]])
        assert gpu_state(manager) == before
        assert manager.load(hit, fresh[:2]).result(WAIT_S) == 2 * BLOCK
        manager.release(fresh[:2])


def test_a_lookup_run_is_held_by_the_caller_until_released() -> None:
    with TierManager(topology(6, 10)) as manager:
        tokens = np.arange(2 * BLOCK)
        compute_and_store(manager, tokens)
        first, second = manager.lookup(tokens), manager.lookup(tokens)  # two requests share the prefix
        run = first.gpu_block_ids
        assert run == second.gpu_block_ids and len(run) == 2
        manager.release(run)
        manager.release(second.gpu_block_ids)
        with pytest.raises(ValueError, match="not held"):
            manager.release(run)  # both holds are gone
        manager.load(first, [])
        manager.load(second, [])


# ---- after close ----------------------------------------------------------------------------


def remote_engine(latency_ms: float) -> TierManager:
    remote = {"type": "simulated", "name": "sim", "options": {"latency_ms": latency_ms}}
    queues = {"prefetch": "best_effort", "remote_lookup_timeout_ms": 60_000}
    return TierManager(topology(8, 8, remotes=[remote], queues=queues))


def test_poll_after_close_with_best_effort_loads_in_flight() -> None:
    manager = remote_engine(latency_ms=0)
    manager.start_blocking()
    tokens = np.arange(4 * BLOCK)
    compute_and_store(manager, tokens)
    deadline = time.monotonic() + WAIT_S
    while manager.stats()["queues"]["pending_stores"]:
        assert time.monotonic() < deadline, "the remote writes never landed"
        time.sleep(0.001)
    manager.release(manager.allocate(8))  # GPU emptied: demoted to the CPU tier
    for key in manager.hasher.keys(tokens):  # only the remote's copies are left
        assert manager.parts.cpu.table.discard(key)
    manager.parts.remotes[0].hold("get")  # the best-effort load stays in flight through close
    hit = manager.lookup(tokens)
    while hit.pending:
        time.sleep(0.001)
        hit = manager.lookup(tokens)
    assert hit.tier_blocks["sim"] == 4
    fresh = manager.allocate(4)
    transfer = manager.load(hit, fresh)
    manager.close_blocking()
    finished = manager.poll()  # raised "Event loop is closed"
    assert transfer.done() and transfer in finished
    assert transfer.result() == 0
    assert manager.poll() == []
    assert isinstance(manager.stats(), dict)


def test_every_call_after_close_works_or_raises_the_documented_error() -> None:
    """Calls that move data raise ``RuntimeError("TierManager is closed")``; hand-backs and reads work."""
    manager = remote_engine(latency_ms=0)
    manager.start_blocking()
    tokens = np.arange(2 * BLOCK)
    ids = manager.allocate(2)
    manager.store(tokens, ids).result(WAIT_S)
    hit = manager.lookup(tokens)
    manager.close_blocking()
    refused: dict[str, Any] = {
        "lookup": lambda: manager.lookup(tokens),
        "lookup_wait": lambda: manager.lookup_wait(tokens),
        "allocate": lambda: manager.allocate(1),
        "store": lambda: manager.store(tokens, ids),
        "load": lambda: manager.load(hit, []),
        "observe_prefill": lambda: manager.observe_prefill(100, 0.1),
        "start_blocking": manager.start_blocking,
    }
    for name, call in refused.items():
        with pytest.raises(RuntimeError, match="TierManager is closed"):
            call()
            pytest.fail(f"{name} after close did not raise")
    manager.release(hit)
    manager.release(ids)
    with pytest.raises(ValueError, match="not held"):
        manager.release(ids)
    assert all(transfer.done() for transfer in manager.poll())
    assert isinstance(manager.stats(), dict)
    manager.close_blocking()  # closing twice is fine
