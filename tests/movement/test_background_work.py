"""Work that starts on the background loop finishes there, and counters written there read safely anywhere.

A block loaded from a slower remote is written into the faster one without the
engine calling the manager again; ``stats()`` can be read while the loop thread
counts, and no increment is lost.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from support.manager_helpers import TINY_LAYOUT, block_kv, topology

from tiercache.manager.tier_manager import TierManager
from tiercache.telemetry.counters import Metrics

BLOCK = TINY_LAYOUT["block_size"]
WAIT_S = 10.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def test_a_block_read_from_a_slower_remote_reaches_the_faster_one_without_another_call() -> None:
    fast = {"type": "simulated", "name": "fast", "options": {"latency_ms": 0}}
    slow = {"type": "simulated", "name": "slow", "write_policy": "write_back", "options": {"latency_ms": 0}}
    with TierManager(topology(8, 8, remotes=[fast, slow])) as manager:
        tokens = np.arange(4 * BLOCK) + 500
        keys = manager.hasher.keys(tokens)
        fast_tier, slow_tier = manager.parts.remotes
        for key in keys:
            payload = block_kv(manager, key).contiguous().view(torch.uint8).numpy().tobytes()
            slow_tier.store.save(key, slow_tier.codec.encode_value(key, payload))
        hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
        assert hit.tier_blocks["slow"] == 4
        fresh = manager.allocate(4)
        assert manager.load(hit, fresh).result(WAIT_S) == 4 * BLOCK
        # From here on the engine calls nothing: the promotion must be on its way by itself.
        deadline = time.monotonic() + WAIT_S
        while not all(key in fast_tier.store.data for key in keys):
            assert time.monotonic() < deadline, "the promotion waited for the engine's next call"
            time.sleep(0.002)
        manager.release(fresh)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Let threads switch as often as the interpreter allows, so races show up within a short test."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_counters_written_by_several_threads_read_safely_and_lose_nothing(fast_switching: None) -> None:
    metrics = Metrics()
    writers, adds, names = 4, 4_000, 400
    errors: list[BaseException] = []
    done = threading.Event()

    def write(index: int) -> None:
        for step in range(adds):
            metrics.add("all", "shared")
            metrics.add(f"tier{index}", f"counter{step % 500}")
            metrics.observe(f"tier{index}", f"op{step % names}", 0.1)  # new names keep appearing at first

    def read() -> None:
        while not done.is_set():
            try:
                metrics.snapshot()
            except BaseException as error:  # any failure of a read is the defect
                errors.append(error)
                return

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(index,)) for index in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    reader.join()
    assert errors == [], f"stats() raced the writers: {errors[0]!r}"
    snapshot = metrics.snapshot()
    assert snapshot["all"]["shared"] == writers * adds, "increments were lost"
    assert sum(snapshot["tier0"][f"latency_op{name}"]["count"] for name in range(names)) == adds
