"""Config fuzzer: hundreds of seeded, mutated topologies; only ConfigError ever comes out of load_config.

Every rejection names the file; every accepted topology is one the tiers can
use as it stands: its Redis URLs parse with redis-py's own parser and its local
tiers fit in the memory this machine has available.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest
import yaml
from redis.connection import parse_url
from support.config_mutations import CONFIG_DIR, NESTING_DEPTH, mutated_topologies

from tiercache.blocks.codec import Codec
from tiercache.config import ConfigError, TierCacheConfig, load_config
from tiercache.config.machine import host_memory_available
from tiercache.testing.redis_servers import FINGERPRINT
from tiercache.tiers import tier_class
from tiercache.tiers.base import RemoteContext

SEED = 20261123
CASES = 320
URL_FIELDS = ("url", "central_url", "region_url")


def outcome_of(path: Path) -> tuple[str, TierCacheConfig | None, str]:
    """``(outcome, config, message)``: outcome is ``accepted``, ``ConfigError`` or another exception's name."""
    try:
        return "accepted", load_config(path, environ={}), ""
    except ConfigError as error:
        return "ConfigError", None, str(error)
    except Exception as error:  # the fuzzer's finding: anything else escaped
        return type(error).__name__, None, str(error)


def check_usable(config: TierCacheConfig) -> None:
    """What an accepted topology promises: remote tiers that can be built, URLs that redis-py parses,
    local tiers that fit in memory, lookups and prefetches that can succeed."""
    codec = Codec(FINGERPRINT)
    for tier in config.tiers[2:]:
        tier_class(tier.type)(RemoteContext(tier.name, codec, config.layout.bytes_per_block), tier.options)
        options = dataclasses.asdict(tier.options)
        for name in URL_FIELDS:
            if options.get(name):
                parse_url(options[name])
    local_bytes = sum(tier.capacity_blocks * config.layout.bytes_per_block for tier in config.tiers[:2])
    assert local_bytes <= host_memory_available() or config.tiers[0].options.device.startswith("cuda")
    queues = config.queues
    assert queues.remote_lookup_timeout_ms > 0 and queues.prefetch_timeout_ms > 0


def test_only_config_errors_come_out(tmp_path: Path) -> None:
    counts: collections.Counter[str] = collections.Counter()
    escaped = []
    for index, (label, text) in enumerate(mutated_topologies(SEED, CASES)):
        path = tmp_path / f"case{index}.yaml"
        path.write_bytes(text)
        outcome, config, message = outcome_of(path)
        counts[outcome] += 1
        if outcome == "ConfigError":
            assert message.startswith(str(path)), (label, message)
            assert ": expected " in message, (label, message)
        elif outcome == "accepted":
            check_usable(config)
        else:
            escaped.append((label, outcome, message[:200]))
    assert sum(counts.values()) >= 300
    assert not escaped, f"{len(escaped)} escaped: {counts}\n" + "\n".join(map(str, escaped))
    assert counts["ConfigError"] > counts["accepted"] > 0, counts


def load_seed(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())


def set_path(data: dict, dotted: str, value: object) -> dict:
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[last] = value
    return data


ONE_FIELD_CASES = [
    ("default", "queues.remote_lookup_timeout_ms", -1, "queues.remote_lookup_timeout_ms", "(0.0,"),
    ("default", "queues.prefetch_timeout_ms", 0, "queues.prefetch_timeout_ms", "(0.0,"),
    ("default", "queues.transfer_concurrency", 10**12, "queues.transfer_concurrency", "[1, 1024]"),
    ("default", "tiers.1.capacity_blocks", 10**12, "tiers[1].capacity_blocks", "MemAvailable"),
    ("default", "tiers.0.capacity_blocks", 2**62, "tiers[0].capacity_blocks", "blocks of"),
    ("default", "tiers.0.options.device", "cuda:abc", "tiers[0].options.device", "'cuda:N'"),
    ("default", "tiers.1.policy_options", {"small_ratio": 2.0}, "tiers[1].policy_options.small_ratio", "[0, 1)"),
    ("redis", "tiers.2.options.url", "redis://127.0.0.1:port", "tiers[2].options.url", "port 1-65535"),
    ("redis", "tiers.2.options.url", "redis://127.0.0.1:6379/x", "tiers[2].options.url", "integer db"),
    ("regional", "tiers.2.options.central_url", "http://h:1", "tiers[2].options.central_url", "redis://"),
    ("regional", "tiers.2.options.replication_workers", 10**12, "tiers[2].options.replication_workers", "1024"),
    ("regional", "tiers.2.options.socket_timeout_ms", -5, "tiers[2].options.socket_timeout_ms", "(0.0,"),
    ("redis", "tiers.3.options.threads", 10**9, "tiers[3].options.threads", "1024"),
    ("default", "layout.head_dim", 2**40, "layout.head_dim", "up to"),
]


@pytest.mark.parametrize(("seed", "dotted", "value", "field", "expected"), ONE_FIELD_CASES)
def test_one_bad_field(tmp_path: Path, seed: str, dotted: str, value: object, field: str, expected: str) -> None:
    """Each of the fuzzer's families, pinned: the file, the exact field path and the expectation."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(set_path(load_seed(seed), dotted, value)))
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert caught.value.field_path == field, str(caught.value)
    assert str(caught.value).startswith(str(path)) and expected in caught.value.expected, str(caught.value)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (b"model:\n  id: caf\xc3\x28\n", "line 2, byte"),
        (b"model: " + b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH + b"\n", "document"),
    ],
)
def test_unreadable_text(tmp_path: Path, text: bytes, where: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert caught.value.field_path.startswith(where) and str(caught.value).startswith(str(path))
