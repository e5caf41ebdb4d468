"""A router's view, rebuilt from KV events in another process, equals what the tiers really hold.

The subscriber (``router_subscriber.py``) knows only the wire: vLLM's structs,
sequence numbers and the replay socket. After each scenario settles, its view
per medium is compared with the real contents of every tier: the GPU and CPU
slot tables, and each remote asked directly what it holds. Scenarios: presence
checks and reads that time out (and a lane's open breaker), a bounded remote that
drops its oldest blocks, a file tier's clean-up, a Redis server evicting under
``maxmemory`` and expiring by TTL.
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import module_command, with_tests_on_path
from support.manager_helpers import block_kv, compute_and_store, read_block, topology, write_block

from tiercache.manager.tier_manager import TierManager
from tiercache.telemetry.events.wire import block_hash
from tiercache.testing.redis_servers import EXPIRED_CHANNEL
from tiercache.tiers.base import Presence

pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")

TOPIC = "kv-events"
EVENTS = {
    "enabled": True,
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
    "topic": TOPIC,
}
WAIT_S = 10.0
"""Upper bound on waiting for background work or the subscriber (a hang detector, never a speed judgement)."""
SETTLE_S = 3.0
"""How long the view may take to catch up with a remote's own report (a notification, a check after a miss)."""
BIG_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32", "block_size": 16}
"""32 KiB blocks: a handful fill a small file tier or a Redis ``maxmemory``."""
TINY_BLOCK = 2
"""Tokens per block of ``manager_helpers.TINY_LAYOUT``."""


class RouterProcess:
    """The subscriber process and the one question it answers: its view through the last published batch."""

    def __init__(self, manager: TierManager) -> None:
        publisher = manager.parts.events._publisher
        self.manager = manager
        self.process = subprocess.Popen(
            module_command("router_subscriber", publisher.endpoint, publisher.replay_endpoint, TOPIC),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=with_tests_on_path(),
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], WAIT_S)
        assert ready, "the subscriber process did not answer"
        return self.process.stdout.readline().strip()

    def view(self) -> dict[str, set[int]]:
        events = self.manager.parts.events
        assert events.flush()
        last = events.stats()["published"] - 1
        assert self.process.stdin is not None
        self.process.stdin.write(f"view {last}\n")
        self.process.stdin.flush()
        return {medium: set(hashes) for medium, hashes in json.loads(self._line()).items() if hashes}

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            try:
                self.process.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def residency(manager: TierManager, keys: list[bytes]) -> dict[str, set[int]]:
    """What every tier really holds, as wire hashes: slot tables, and each remote asked about ``keys``."""
    truth: dict[str, set[int]] = {}
    for tier in (manager.gpu, manager.parts.cpu):
        table = tier.table
        bound = (table.key_of(slot) for slot in range(table.num_slots))
        truth[tier.name] = {block_hash(key) for key in bound if key is not None and table.readable(key) is not None}
    for remote in manager.parts.remotes:
        held = manager.parts.runtime.submit(remote.contains(keys)).result(WAIT_S)
        assert Presence.UNKNOWN not in held, f"{remote.name} could not tell what it holds"
        truth[remote.name] = {block_hash(key) for key, found in zip(keys, held, strict=True) if found is Presence.HELD}
    return {medium: hashes for medium, hashes in truth.items() if hashes}


def at_rest(manager: TierManager) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        queues = manager.stats()["queues"]
        if not (queues["pending_stores"] or queues["in_flight_cpu_writes"] or queues["in_flight_copies"]):
            return
        assert time.monotonic() < deadline, f"background work never settled: {queues}"
        time.sleep(0.005)


def assert_view_is_true(router: RouterProcess, manager: TierManager, keys: list[bytes]) -> dict[str, set[int]]:
    """The view equals the real contents, once what is in flight has landed (a remote's report may lag a little)."""
    at_rest(manager)
    deadline = time.monotonic() + SETTLE_S
    while True:
        truth, view = residency(manager, keys), router.view()
        if view == truth or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for medium in sorted(truth.keys() | view.keys()):
        believed, real = view.get(medium, set()), truth.get(medium, set())
        assert believed == real, (
            f"{medium}: the router believes {len(believed)} blocks, the tier holds {len(real)}; "
            f"{len(believed - real)} believed but gone, {len(real - believed)} held but unknown"
        )
    return truth


@pytest.fixture
def router_of() -> Iterator[Any]:
    routers: list[RouterProcess] = []

    def start(manager: TierManager) -> RouterProcess:
        routers.append(RouterProcess(manager))
        return routers[-1]

    yield start
    for router in routers:
        router.close()


def prompt(blocks: int, salt: int, block_size: int = TINY_BLOCK) -> np.ndarray:
    return np.arange(blocks * block_size) + salt * 100_000


def compute(manager: TierManager, tokens: np.ndarray) -> None:
    """A request with nothing reused, whose writes land before the next one."""
    compute_and_store(manager, tokens, WAIT_S)
    at_rest(manager)


def computed(manager: TierManager, count: int, block_size: int = TINY_BLOCK) -> tuple[list[np.ndarray], list[bytes]]:
    """``count`` four-block prompts computed one after the other; the prompts and all their keys."""
    prompts = [prompt(4, salt, block_size) for salt in range(count)]
    for tokens in prompts:
        compute(manager, tokens)
    return prompts, [key for tokens in prompts for key in manager.hasher.keys(tokens)]


def serve(manager: TierManager, tokens: np.ndarray) -> int:
    """Look up (waiting out a pending answer), load, check the KV, compute the rest, store, release."""
    hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
    fresh = manager.allocate(len(hit.keys) - len(hit.gpu_block_ids))
    loaded = manager.load(hit, fresh[: hit.num_lower_blocks]).result(WAIT_S) // manager.block_size
    table = hit.gpu_block_ids + fresh
    reused = len(hit.gpu_block_ids) + loaded
    for position, block in enumerate(table):
        expected = block_kv(manager, hit.keys[position])
        if position < reused:
            assert bool((read_block(manager, block) == expected).all()), f"block {position} is wrong KV"
        else:
            write_block(manager, block, expected)
    manager.store(tokens, table).result(WAIT_S)
    manager.release(table)
    return reused


def sim(**options: Any) -> dict[str, Any]:
    return {"type": "simulated", "name": "sim", "options": {"latency_ms": 0, **options}}


def test_presence_checks_and_reads_that_time_out_remove_nothing_from_the_view(router_of: Any) -> None:
    config = topology(4, 4, remotes=[sim()], events=EVENTS, queues={"remote_lookup_timeout_ms": 50})
    with TierManager(config) as manager:
        router = router_of(manager)
        prompts, keys = computed(manager, 3)  # the first prompt is now only in the remote
        assert_view_is_true(router, manager, keys)
        tier = manager.parts.remotes[0]

        tier.hold("contains")  # presence checks time out, then the lane's breaker opens: UNKNOWN, not "not held"
        for _ in range(4):
            hit = manager.lookup_wait(prompts[0], timeout_s=WAIT_S)
            assert hit.tier_blocks["sim"] == 0
            manager.load(hit, [])
        tier.unhold("contains")
        assert manager.stats()["tiers"]["sim"]["lane_breaker_opened"] >= 1
        assert_view_is_true(router, manager, keys)

        deadline = time.monotonic() + WAIT_S
        while (hit := manager.lookup_wait(prompts[0], timeout_s=WAIT_S)).tier_blocks["sim"] != 4:
            manager.release(hit)  # the breaker lets one trial call through after its back-off
            assert time.monotonic() < deadline, "the remote never came back"
            time.sleep(0.05)
        tier.hold("get")  # the read passes its deadline: the blocks are still there
        fresh = manager.allocate(4)
        assert manager.load(hit, fresh).result(WAIT_S) == 0
        manager.release(fresh)
        tier.unhold("get")
        assert_view_is_true(router, manager, keys)

        deadline = time.monotonic() + WAIT_S
        while serve(manager, prompts[0]) != 4:  # served from the remote once the lane is closed again
            assert time.monotonic() < deadline, "the remote never served again"
            time.sleep(0.05)
        assert_view_is_true(router, manager, keys)


def test_a_bounded_remote_that_drops_its_oldest_blocks(router_of: Any) -> None:
    config = topology(4, 4, remotes=[sim(capacity_blocks=6)], events=EVENTS)
    with TierManager(config) as manager:
        router = router_of(manager)
        prompts, keys = computed(manager, 5)
        truth = assert_view_is_true(router, manager, keys)
        assert len(truth["sim"]) == 6
        assert serve(manager, prompts[-1]) == 4
        assert_view_is_true(router, manager, keys)


def test_a_file_tier_clean_up(router_of: Any, tmp_path: Path) -> None:
    options = {"path": str(tmp_path), "max_blocks": 8, "segment_bytes": 65536, "gc_interval_s": 3600}
    remote = {"type": "file", "name": "disk", "options": options}
    with TierManager(topology(4, 4, layout=BIG_LAYOUT, remotes=[remote], events=EVENTS)) as manager:
        router = router_of(manager)
        _, keys = computed(manager, 5, BIG_LAYOUT["block_size"])
        truth = assert_view_is_true(router, manager, keys)
        assert 0 < len(truth["disk"]) <= 8
        assert manager.parts.remotes[0].stats()["gc_removed_segments"] > 0


@pytest.mark.parametrize(
    ("server", "tier"),
    [({"maxmemory": "2mb", "maxmemory_policy": "allkeys-lru"}, {}), ({}, {"ttl_s": 0.5})],
    ids=["maxmemory", "ttl"],
)
def test_a_redis_that_evicts_or_expires(
    router_of: Any, redis_factory: Any, server: dict[str, str], tier: dict[str, Any]
) -> None:
    redis = redis_factory(**server)
    remote = {"type": "redis", "name": "redis", "options": {"url": redis.url, **tier}}
    with TierManager(topology(4, 4, layout=BIG_LAYOUT, remotes=[remote], events=EVENTS)) as manager:
        router = router_of(manager)
        _, keys = computed(manager, 24, BIG_LAYOUT["block_size"])
        if "ttl_s" in tier:
            time.sleep(2 * tier["ttl_s"])
        truth = assert_view_is_true(router, manager, keys)
        assert len(truth.get("redis", set())) < len(keys), "the server dropped nothing: the test proves nothing"


def test_requests_sharing_a_new_prompt_leave_its_remote_blocks_announced(router_of: Any) -> None:
    """Both look up before either stores: the second's "not held" is stale once the first's writes landed."""
    with TierManager(topology(8, 8, remotes=[sim()], events=EVENTS)) as manager:
        router = router_of(manager)
        tokens = prompt(4, 77)
        keys = manager.hasher.keys(tokens)
        first = manager.lookup_wait(tokens, timeout_s=WAIT_S)
        second = manager.lookup_wait(tokens, timeout_s=WAIT_S)
        assert first.num_blocks == second.num_blocks == 0
        manager.load(first, [])
        compute(manager, tokens)  # the first request computes and stores: written through to the remote
        manager.load(second, [])  # the second goes ahead with what its lookup saw
        compute_and_store(manager, tokens)
        truth = assert_view_is_true(router, manager, keys)
        assert len(truth["sim"]) == 4


def test_a_redis_cluster_whose_nodes_expire_their_keys(router_of: Any, redis_cluster: Any) -> None:
    """Each node publishes its own keys' expiries: the tier listens on every node."""
    remote = {"type": "redis", "name": "cluster", "options": {"url": redis_cluster.url, "cluster": True, "ttl_s": 0.5}}
    with TierManager(topology(4, 4, layout=BIG_LAYOUT, remotes=[remote], events=EVENTS)) as manager:
        router = router_of(manager)
        assert [node.subscribers(EXPIRED_CHANNEL) for node in redis_cluster.nodes] == [1] * len(redis_cluster.nodes)
        _, keys = computed(manager, 6, BIG_LAYOUT["block_size"])
        time.sleep(1.0)
        truth = assert_view_is_true(router, manager, keys)
        assert "cluster" not in truth, "every key expired"
