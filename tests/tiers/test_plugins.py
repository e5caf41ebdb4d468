"""Tiers and policies outside tiercache, named in a topology by module path (``package.module:Class``).

A tier defined in a test module (``plugin_tier``) and a policy (``plugin_policy``)
are loaded like registered ones, checked at load time like the rest (a bad path,
a class of the wrong kind, bad options: the file, the field and what was
expected), and then serve an engine's requests. The conformance suite runs on
the plug-in tier in ``test_conformance.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import plugin_tier
from support.manager_helpers import TINY_LAYOUT, compute_and_store, prompt, serve, until
from support.plugin_policy import FifoPolicy

from tiercache.config import ConfigError, config_from_dict, load_config
from tiercache.manager.tier_manager import TierManager

TOPOLOGY: dict[str, Any] = {
    "model": {"id": "plugin-model"},
    "layout": TINY_LAYOUT,
    "tiers": [
        {"type": "gpu", "capacity_blocks": 8, "options": {"device": "cpu"}},
        {"type": "cpu", "capacity_blocks": 8},
        {"name": "dict", "type": "support.plugin_tier:DictTier", "options": {"store": "plugins"}},
    ],
}


@pytest.fixture(autouse=True)
def empty_stores() -> None:
    plugin_tier.STORES.clear()


def changed(path: tuple, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(TOPOLOGY)
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


def load(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "plugins.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, environ={})


def test_a_plugin_tier_serves_what_another_engine_stored(tmp_path: Path) -> None:
    """Two managers on one topology naming ``support.plugin_tier:DictTier``: the second reuses the first's blocks."""
    config = load(tmp_path, TOPOLOGY)
    assert isinstance(config.tiers[2].options, plugin_tier.DictOptions)
    tokens = prompt(4, 1)
    with TierManager(config) as writer:
        compute_and_store(writer, tokens)
        until(lambda: writer.stats()["queues"]["pending_stores"] == 0)
    assert len(plugin_tier.STORES["plugins"]) == 4
    assert "put_checksums_carried" not in writer.stats()["tiers"]["dict"], "a tier without takes_checksums gets none"
    with TierManager(load(tmp_path, TOPOLOGY)) as reader:
        assert serve(reader, tokens) == 4, "every block comes from the plug-in tier, byte-exact"
        assert reader.stats()["tiers"]["dict"]["store"]["hits"] == 4


def test_a_plugin_policy_makes_the_gpu_pool_s_decisions() -> None:
    """FIFO ignores hits: after A, B, a hit on A, then C, FIFO evicts A where LRU evicts B."""

    def survivors(policy: str) -> tuple[int, int]:
        data = changed(("tiers",), [{"type": "gpu", "capacity_blocks": 4, "options": {"device": "cpu"}}])
        data["tiers"][0]["policy"] = policy
        with TierManager(config_from_dict(data, environ={})) as manager:
            a, b, c = prompt(2, 1), prompt(2, 2), prompt(2, 3)
            compute_and_store(manager, a)
            compute_and_store(manager, b)
            assert serve(manager, a) == 2  # a hit on A
            compute_and_store(manager, c)
            counts = []
            for tokens in (a, b):
                hit = manager.lookup(tokens)
                counts.append(len(hit.gpu_block_ids))
                manager.release(hit)
            if policy.endswith("FifoPolicy"):
                assert type(manager.gpu.table.policy) is FifoPolicy
            return counts[0], counts[1]

    assert survivors("support.plugin_policy:FifoPolicy") == (0, 2)
    assert survivors("lru") == (2, 0)


@pytest.mark.parametrize(
    ("path", "value", "field", "says"),
    [
        (("tiers", 2, "type"), "no_such_package.tiers:S3Tier", "tiers[2].type", "could not be imported"),
        (("tiers", 2, "type"), "support.plugin_tier:NoSuchTier", "tiers[2].type", "has no attribute 'NoSuchTier'"),
        (("tiers", 2, "type"), "support.plugin_policy:FifoPolicy", "tiers[2].type", "not a subclass of"),
        (("tiers", 2, "type"), "tiercache.tiers.base:RemoteTier", "tiers[2].type", "does not implement"),
        (("tiers", 2, "type"), "support.plugin_broken:Tier", "tiers[2].type", "broken on purpose"),
        (("tiers", 2, "type"), "plugin tier:Dict", "tiers[2].type", "not a module path"),
        (("tiers", 2, "options"), {"store": "x", "colour": 1}, "tiers[2].options.colour", "known fields"),
        (("tiers", 2, "options"), {"store": ""}, "tiers[2].options", "store must be a non-empty name"),
        (("tiers", 0, "policy"), "support.plugin_tier:DictTier", "tiers[0].policy", "not a subclass of"),
        (("tiers", 0, "policy"), "no_such_package:Mine", "tiers[0].policy", "could not be imported"),
        (("tiers", 1, "policy_options"), {"ghosts": 3}, "tiers[1].policy_options.ghosts", "unknown option"),
    ],
)
def test_a_bad_plugin_names_the_file_the_field_and_the_expectation(
    tmp_path: Path, path: tuple, value: Any, field: str, says: str
) -> None:
    data = changed(path, value)
    if path[-1] == "policy_options":
        data["tiers"][1]["policy"] = "support.plugin_policy:FifoPolicy"
    with pytest.raises(ConfigError) as raised:
        load(tmp_path, data)
    message = str(raised.value)
    assert str(tmp_path / "plugins.yaml") in message and f"{field}:" in message and says in message, message
