"""lookup_wait / lookup_async: a scheduler waits out a pending remote answer in one call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.manager_helpers import topology

from tiercache.manager.tier_manager import TierManager
from tiercache.tiers.simulated import SimulatedStore

STORE = "lookup-wait"
PROMPT = list(range(100, 113))
"""Six full blocks of the tiny layout (block size 2) and one partial."""
BLOCKS = len(PROMPT) // 2
NEVER_S = 30.0
"""A remote that answers after this long has not answered during the test."""


@pytest.fixture
def stored() -> Iterator[None]:
    """An engine computed PROMPT's blocks and wrote them to a shared simulated remote, then stopped."""
    SimulatedStore.forget(STORE)
    remote = {"name": "remote", "type": "simulated", "options": {"store": STORE, "latency_ms": 1}}
    with TierManager(topology(remotes=[remote], gpu_blocks=8, cpu_blocks=8)) as first:
        ids = first.allocate(BLOCKS)
        assert first.store(PROMPT, ids).result() == 2 * BLOCKS
        first.release(ids)
    yield
    SimulatedStore.forget(STORE)


def engine(latency_ms: float, lookup_timeout_ms: float = 200, write_policy: str = "write_through") -> TierManager:
    options = {"store": STORE, "latency_ms": latency_ms}
    remote = {"name": "remote", "type": "simulated", "write_policy": write_policy, "options": options}
    config = topology(remotes=[remote], queues={"remote_lookup_timeout_ms": lookup_timeout_ms})
    return TierManager(config)


def test_lookup_wait_returns_the_remote_answer(stored: None) -> None:
    with engine(latency_ms=5) as manager:
        hit = manager.lookup_wait(PROMPT)
        assert not hit.pending
        assert hit.tier_blocks == {"gpu": 0, "cpu": 0, "remote": BLOCKS}


async def test_lookup_async_returns_the_remote_answer(stored: None) -> None:
    async with engine(latency_ms=5) as manager:
        hit = await manager.lookup_async(PROMPT)
        assert not hit.pending
        assert hit.tier_blocks["remote"] == BLOCKS


def test_past_its_timeout_a_pending_lookup_falls_back_to_the_local_tiers(stored: None) -> None:
    never = NEVER_S * 1000
    with engine(latency_ms=never, lookup_timeout_ms=never, write_policy="write_back") as manager:
        ids = manager.allocate(2)
        manager.store(PROMPT[:4], ids).result()
        manager.release(ids)  # two blocks on the GPU
        hit = manager.lookup_wait(PROMPT, timeout_s=0)
        assert not hit.pending
        assert hit.tier_blocks == {"gpu": 2, "cpu": 0, "remote": 0}, "the remote counts as a miss, the GPU does not"
        manager.release(hit)
        manager.release(manager.allocate(manager.gpu.num_blocks))  # nothing was left pinned
