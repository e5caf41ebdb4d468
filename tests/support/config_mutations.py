"""Seeded mutations of the shipped topologies, for the config fuzzer.

Each mutation starts from one of ``configs/*.yaml`` (plus a simulated and a file
tier appended, so every tier type is exercised) and changes a few things the
way a typo or a bad deploy script would: a value replaced by a huge, negative,
zero, non-finite or wrongly typed one, a bad enum name, bad ``policy_options``,
Redis URLs with a non-integer port or db, a bad device string, absurd worker
counts, negative timeouts; or the file's text itself is broken (invalid UTF-8,
deeply nested YAML, truncation). ``mutated_topologies(seed, count)`` returns
``(label, file bytes)`` pairs, the same for the same seed.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from support import REPO

CONFIG_DIR = REPO / "configs"
NESTING_DEPTH = 600
"""Deeper than the YAML parser can follow within Python's default recursion limit."""

BROKEN_TEXT_EVERY = 12
"""One mutation in this many also breaks the file's text (UTF-8, nesting, truncation)."""

EXTRA_TIERS = [
    {"name": "sim", "type": "simulated", "options": {"latency_ms": 1.0, "capacity_blocks": 64}},
    {"name": "disk", "type": "file", "options": {"path": "/tmp/tiercache-fuzz", "max_blocks": 64}},
]

BAD_SCALARS: list[Any] = [
    -1,
    0,
    -(10**9),
    10**12,
    10**30,
    2**63,
    1e308,
    float("nan"),
    float("inf"),
    -float("inf"),
    1.5,
    True,
    None,
    "",
    "abc",
    "-5GiB",
    "1e400 GiB",
    [],
    [1, [2, [3]]],
    {},
    {"nested": {"deeper": 1}},
]

BAD_URLS = [
    "redis://127.0.0.1:port",
    "redis://127.0.0.1:6379/abc",
    "redis://127.0.0.1:99999",
    "redis://127.0.0.1:-1",
    "redis://",
    "http://127.0.0.1:6379",
    "redis://[::1",
    "redis://127.0.0.1:6379/-3",
    "redis://127.0.0.1:6379/0/1",
    "redis://h:6379?db=x",
    "127.0.0.1:6379",
    "",
    12345,
]

BAD_DEVICES = ["cuda:abc", "tpu", "cuda:-1", "cuda:99", "cpu:x", "", "CUDA", "cuda:0:1", "meta", 5, None]

POLICY_OPTIONS = [
    ("s3fifo", {"small_ratio": 2.0}),
    ("s3fifo", {"small_ratio": "a tenth"}),
    ("s3fifo", {"ghost_ratio": 1e308}),
    ("s3fifo", {"ghost_ratio": -1}),
    ("s3fifo", {"move_to_main_threshold": 0}),
    ("s3fifo", {"move_to_main_threshold": [1]}),
    ("s3fifo", {"small_ratio": float("nan")}),
    ("twoq", {"in_ratio": 1.0}),
    ("twoq", {"out_ratio": "half"}),
    ("twoq", {"out_ratio": 10**30}),
    ("arc", {"p": 3}),
    ("lru", {"capacity": 3}),
]

COUNT_FIELDS = [
    "replication_workers",
    "replication_queue_blocks",
    "replication_batch_blocks",
    "replication_retries",
    "connections",
    "pipeline_bytes",
    "threads",
    "transfer_concurrency",
    "batch_blocks",
    "max_pending_stores",
    "breaker_failures",
    "max_batch_blocks",
    "max_blocks",
]
ABSURD_COUNTS = [10**12, 2**40, 10**6, -1, 0]

TIMEOUT_FIELDS = [
    "remote_lookup_timeout_ms",
    "prefetch_timeout_ms",
    "prefetch_timeout_ms_per_1k_tokens",
    "socket_timeout_ms",
    "timeout_s",
    "connect_timeout_s",
    "gc_interval_s",
    "max_age_s",
    "retry_backoff_ms",
    "close_flush_ms",
    "breaker_backoff_s",
    "latency_ms",
    "timeout_ms",
    "ttl_s",
]
BAD_TIMEOUTS = [-1, 0, -0.5, float("nan"), float("inf"), 10**12]

HUGE_SIZES = [10**9, 10**12, 2**62, "900TiB", "99999999999GiB"]


def seed_topologies() -> list[tuple[str, dict]]:
    """The shipped topologies, each with a simulated and a file tier appended."""
    seeds = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        names = {tier.get("name") for tier in data["tiers"]}
        data["tiers"] += [copy.deepcopy(tier) for tier in EXTRA_TIERS if tier["name"] not in names]
        seeds.append((path.stem, data))
    return seeds


def _leaves(node: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path (tuple of keys/indices) to a value in a nested mapping/list."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key)
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield (*path, index)
            yield from _leaves(value, (*path, index))


def _set(data: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


def _fields_named(data: dict, names: list[str] | set[str]) -> list[tuple]:
    return [path for path in _leaves(data) if isinstance(path[-1], str) and path[-1] in names]


def _any_value(rng: random.Random, data: dict) -> str:
    path = rng.choice(list(_leaves(data)))
    _set(data, path, copy.deepcopy(rng.choice(BAD_SCALARS)))
    return "value " + ".".join(map(str, path))


def _huge_capacity(rng: random.Random, data: dict) -> str:
    tier = rng.choice(data["tiers"][:2])
    tier.pop("capacity_blocks", None)
    tier.pop("capacity_bytes", None)
    value = rng.choice(HUGE_SIZES)
    tier["capacity_bytes" if isinstance(value, str) else "capacity_blocks"] = value
    return f"huge capacity {value!r}"


def _huge_layout(rng: random.Random, data: dict) -> str:
    name = rng.choice(["num_layers", "num_kv_heads", "head_dim", "block_size"])
    data["layout"][name] = rng.choice([10**5, 10**9, 2**40])
    return f"huge layout.{name}"


def _bad_enum(rng: random.Random, data: dict) -> str:
    targets = [("layout", "dtype"), ("layout", "memory"), ("queues", "prefetch")]
    tier = rng.choice(data["tiers"])
    choice = rng.randrange(len(targets) + 3)
    if choice < len(targets):
        section, name = targets[choice]
        data.setdefault(section, {})[name] = rng.choice(["bogus", "FLOAT16", 7])
        return f"bad enum {section}.{name}"
    name = ["policy", "write_policy", "type"][choice - len(targets)]
    tier[name] = rng.choice(["bogus", "LRU", 3, None])
    return f"bad enum tiers.{name}"


def _bad_policy_options(rng: random.Random, data: dict) -> str:
    tier = rng.choice(data["tiers"][:2])
    policy, options = rng.choice(POLICY_OPTIONS)
    tier["policy"] = policy
    tier["policy_options"] = copy.deepcopy(options)
    return f"policy_options {policy} {options}"


def _bad_url(rng: random.Random, data: dict) -> str:
    paths = _fields_named(data, {"url", "central_url", "region_url"})
    if not paths:
        return _any_value(rng, data)
    path = rng.choice(paths)
    url = rng.choice(BAD_URLS)
    _set(data, path, url)
    return f"url {url!r}"


def _bad_device(rng: random.Random, data: dict) -> str:
    device = rng.choice(BAD_DEVICES)
    data["tiers"][0].setdefault("options", {})["device"] = device
    return f"device {device!r}"


def _absurd_count(rng: random.Random, data: dict) -> str:
    paths = _fields_named(data, COUNT_FIELDS) or [("queues", "transfer_concurrency")]
    path = rng.choice(paths)
    data.setdefault("queues", {})
    _set(data, path, rng.choice(ABSURD_COUNTS))
    return "count " + ".".join(map(str, path))


def _bad_timeout(rng: random.Random, data: dict) -> str:
    paths = _fields_named(data, TIMEOUT_FIELDS)
    paths += [("queues", "remote_lookup_timeout_ms"), ("queues", "prefetch_timeout_ms")]
    path = rng.choice(paths)
    data.setdefault("queues", {})
    _set(data, path, rng.choice(BAD_TIMEOUTS))
    return "timeout " + ".".join(map(str, path))


VALID_CHANGES: list[tuple[str, Any]] = [
    ("capacity_blocks", 64),
    ("policy", "arc"),
    ("write_policy", "write_back"),
    ("admit_after_hits", 3),
    ("url", "redis://user:secret@127.0.0.1:6390/2"),
    ("central_url", "rediss://central.example:6380/0"),
    ("replication_workers", 8),
    ("socket_timeout_ms", 250),
    ("timeout_s", 0.25),
    ("max_bytes", "2GiB"),
    ("threads", 8),
    ("segment_bytes", "16MiB"),
    ("latency_ms", 3.0),
]


def _valid_change(rng: random.Random, data: dict) -> str:
    """A change within the documented ranges: the topology must stay acceptable (and usable)."""
    name, value = rng.choice(VALID_CHANGES)
    paths = _fields_named(data, {name})
    if not paths:
        data.setdefault("queues", {})["remote_lookup_timeout_ms"] = rng.choice([50, 500.0])
        return "valid queues.remote_lookup_timeout_ms"
    _set(data, rng.choice(paths), value)
    return f"valid {name}"


DATA_MUTATIONS: list[Callable[[random.Random, dict], str]] = [
    _valid_change,
    _valid_change,
    _valid_change,
    _any_value,
    _any_value,
    _huge_capacity,
    _huge_layout,
    _bad_enum,
    _bad_policy_options,
    _bad_url,
    _bad_device,
    _absurd_count,
    _bad_timeout,
]


def _broken_text(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    kind = rng.randrange(4)
    if kind == 0:
        at = rng.randrange(len(text))
        return "invalid utf-8", text[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + text[at:]
    if kind == 1:
        nested = b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH
        return "deep list", text + b"\nextra: " + nested + b"\n"
    if kind == 2:
        nested = b"".join(b"  " * level + b"k:\n" for level in range(NESTING_DEPTH))
        return "deep mapping", text + b"\nextra:\n" + nested
    return "truncated", text[: rng.randrange(len(text))]


def _mutate(rng: random.Random, data: dict) -> str:
    """One data mutation; where an earlier one broke the structure it needs, replace any value instead."""
    try:
        return rng.choice(DATA_MUTATIONS)(rng, data)
    except (TypeError, KeyError, IndexError, AttributeError):
        return _any_value(rng, data)


def mutated_topologies(seed: int, count: int) -> list[tuple[str, bytes]]:
    """``count`` seeded mutations: ``(label, YAML bytes)``."""
    rng = random.Random(seed)
    seeds = seed_topologies()
    out = []
    for index in range(count):
        name, base = rng.choice(seeds)
        data = copy.deepcopy(base)
        labels = [_mutate(rng, data) for _ in range(rng.randint(1, 2))]
        text = yaml.safe_dump(data, sort_keys=False).encode()
        if index % BROKEN_TEXT_EVERY == BROKEN_TEXT_EVERY - 1:
            label, text = _broken_text(rng, text)
            labels.append(label)
        out.append((f"{index}:{name}: " + "; ".join(labels), text))
    return out
