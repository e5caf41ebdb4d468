"""``tiercache inspect``'s checks of the remote tiers: the tier as a whole, and each server of a tier with several.

A tier with one server keeps ``RemoteTier.check_reachability``'s default (no
line per server); a Redis Cluster answers for each master on its own, so a dead
node shows on its line.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.remote.build import build_tier, model_namespace
from tiercache.remote.inspect import inspect_topology
from tiercache.testing.redis_servers import RedisClusterNodes
from tiercache.tiers.base import RemoteTier
from tiercache.tiers.simulated import SimulatedTier

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_size": 8}
CLUSTER_OPTIONS = {"cluster": True, "timeout_s": 0.5, "connect_timeout_s": 0.5}
TIMEOUT_S = 5.0


def topology(remote: dict[str, Any]) -> TierCacheConfig:
    tiers = [
        {"name": "gpu", "type": "gpu", "capacity_blocks": 16, "options": {"device": "cpu"}},
        {"name": "cpu", "type": "cpu", "capacity_blocks": 32},
        remote,
    ]
    return config_from_dict({"model": {"id": "inspect-test"}, "layout": LAYOUT, "tiers": tiers}, environ={})


def connectivity(report: str) -> list[str]:
    """The report's lines after ``connectivity:``."""
    return report.split("connectivity:\n", 1)[1].splitlines()


def test_a_tier_that_keeps_the_default_is_checked_whole() -> None:
    config = topology({"name": "sim", "type": "simulated", "options": {"latency_ms": 0}})
    assert SimulatedTier.check_reachability is RemoteTier.check_reachability
    tier = build_tier(config.tiers[2], model_namespace(config)[1], config.layout.bytes_per_block)
    assert asyncio.run(tier.check_reachability(b"k" * 16)) == []
    report, ok = inspect_topology(config, TIMEOUT_S)
    (line,) = connectivity(report)
    assert ok and line.split()[:2] == ["sim", "reachable"], report


def test_a_cluster_answers_for_each_node_and_names_the_dead_one(redis_cluster: RedisClusterNodes) -> None:
    config = topology({"name": "cluster", "type": "redis", "options": {"url": redis_cluster.url, **CLUSTER_OPTIONS}})
    addresses = {f"{node.host}:{node.port}" for node in redis_cluster.nodes}
    report, ok = inspect_topology(config, TIMEOUT_S)
    tier_line, *node_lines = connectivity(report)
    assert ok and tier_line.split()[:2] == ["cluster", "reachable"], report
    assert {line.split()[2].rstrip(":") for line in node_lines} == addresses, report
    assert all(line.split()[:2] == ["node", "reachable"] for line in node_lines), report

    dead = redis_cluster.nodes[1]
    dead.kill()
    report, ok = inspect_topology(config, TIMEOUT_S)
    _, *node_lines = connectivity(report)
    by_address = {line.split()[2].rstrip(":"): line for line in node_lines}
    assert not ok and set(by_address) == addresses, report
    assert "UNREACHABLE" in by_address.pop(f"{dead.host}:{dead.port}"), report
    assert all(" reachable " in line for line in by_address.values()), report
