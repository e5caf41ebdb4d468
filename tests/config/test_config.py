"""Config validation: every bad topology names the file, the field and what was expected."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from tiercache.blocks.layout import MemoryOrder
from tiercache.bookkeeping.admission import WritePolicy
from tiercache.config import (
    ConfigError,
    PrefetchPolicy,
    QueueConfig,
    config_from_dict,
    default_config_path,
    load_config,
    parse_size,
)

GOOD = {
    "model": {"id": "m"},
    "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "block_size": 4},
    "tiers": [
        {"type": "gpu", "capacity_blocks": 8, "options": {"device": "cpu"}},
        {"type": "cpu", "capacity_bytes": "64KiB", "write_policy": "write_back"},
    ],
    "queues": {"prefetch": "timeout"},
}


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def mutated(change) -> dict:
    data = copy.deepcopy(GOOD)
    change(data)
    return data


def test_good_config_is_typed(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), environ={})
    assert config.layout.memory is MemoryOrder.BLOCK_MAJOR
    assert config.tiers[1].write_policy is WritePolicy.WRITE_BACK
    assert config.queues.prefetch is PrefetchPolicy.TIMEOUT
    block_bytes = 2 * 2 * 4 * 2 * 8 * 2
    assert config.tiers[1].capacity_blocks == 64 * 1024 // block_bytes
    assert [t.name for t in config.tiers] == ["gpu", "cpu"]
    assert config.tiers[0].options.device == "cpu"


def test_each_prefetch_policy_says_how_long_a_load_may_be_waited_for() -> None:
    """``timeout``: a deadline that grows with the tokens; ``best_effort``: none; ``wait_complete``: unbounded."""
    timeout = QueueConfig(
        prefetch=PrefetchPolicy.TIMEOUT, prefetch_timeout_ms=50.0, prefetch_timeout_ms_per_1k_tokens=20.0
    )
    small, large = timeout.prefetch_wait_s(16), timeout.prefetch_wait_s(16_000)
    assert 0.05 < small < large
    assert large == pytest.approx(0.05 + 0.32)
    assert QueueConfig(prefetch=PrefetchPolicy.BEST_EFFORT).prefetch_wait_s(16_000) == 0
    assert QueueConfig(prefetch=PrefetchPolicy.WAIT_COMPLETE).prefetch_wait_s(16) == math.inf


def test_default_config_is_embedded_and_valid() -> None:
    config = load_config(default_config_path(), environ={})
    assert config.tiers[0].type == "gpu"


BAD_CONFIGS = [
    ("unknown tier type", lambda d: d["tiers"][1].update(type="tape"), "tiers[1].type", "one of"),
    ("unknown policy", lambda d: d["tiers"][0].update(policy="mru"), "tiers[0].policy", "one of"),
    ("negative capacity", lambda d: d["tiers"][0].update(capacity_blocks=-3), "tiers[0].capacity_blocks", "positive"),
    ("missing layout", lambda d: d.pop("layout"), "layout", "required"),
    ("missing model id", lambda d: d["model"].pop("id"), "model.id", "required"),
    ("capacity as text", lambda d: d["tiers"][0].update(capacity_blocks="many"), "tiers[0].capacity_blocks", "integer"),
    ("bad size unit", lambda d: d["tiers"][1].update(capacity_bytes="3 parsecs"), "tiers[1].capacity_bytes", "size"),
    ("unknown top-level key", lambda d: d.update(colour="blue"), "colour", "known fields"),
    ("unknown tier key", lambda d: d["tiers"][0].update(capcity_blocks=3), "tiers[0].capcity_blocks", "known fields"),
    ("unknown tier option", lambda d: d["tiers"][0]["options"].update(gpu_id=1), "tiers[0].options.gpu_id", "known"),
    ("bad dtype", lambda d: d["layout"].update(dtype="float13"), "layout", "dtype"),
    ("bool for int", lambda d: d["layout"].update(num_layers=True), "layout.num_layers", "integer"),
    ("bad write policy", lambda d: d["tiers"][1].update(write_policy="sometimes"), "tiers[1].write_policy", "one of"),
    ("bad memory order", lambda d: d["layout"].update(memory="diagonal"), "layout.memory", "one of"),
    ("first tier not gpu", lambda d: d["tiers"].reverse(), "tiers[0].type", "'gpu'"),
    ("no tiers", lambda d: d.update(tiers=[]), "tiers", "non-empty"),
    ("duplicate names", lambda d: d["tiers"][1].update(name="gpu"), "tiers[1].name", "not used"),
    ("tiers not a list", lambda d: d.update(tiers={"type": "gpu"}), "tiers", "a list"),
    ("no local capacity", lambda d: d["tiers"][0].pop("capacity_blocks"), "tiers[0].capacity_blocks", "required"),
    ("both capacities", lambda d: d["tiers"][0].update(capacity_bytes=1 << 20), "tiers[0]", "not both"),
    ("unknown policy option", lambda d: d["tiers"][0].update(policy_options={"x": 3}), "policy_options.x", "one of"),
    ("zero concurrency", lambda d: d["queues"].update(transfer_concurrency=0), "queues.transfer_concurrency", "[1,"),
    ("bad prefetch", lambda d: d["queues"].update(prefetch="psychic"), "queues.prefetch", "one of"),
    ("capacity below one block", lambda d: d["tiers"][1].update(capacity_bytes=10), "tiers[1].capacity_bytes", "block"),
]


@pytest.mark.parametrize(("label", "change", "field", "expected"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_file_field_and_expectation(tmp_path: Path, label, change, field, expected) -> None:
    path = write(tmp_path, mutated(change))
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert field in caught.value.field_path or field in message, message
    assert expected in message, message


def test_a_misspelt_field_gets_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capcity_blocks: .*did you mean 'capacity_blocks'"):
        load_config(write(tmp_path, mutated(lambda d: d["tiers"][0].update(capcity_blocks=3))), environ={})


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  id: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: line \d+"):
        load_config(path, environ={})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable YAML file"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a mapping"):
        load_config(write(tmp_path, ["gpu"]), environ={})


def test_environment_overrides_by_index_and_name(tmp_path: Path) -> None:
    environ = {
        "TIERCACHE_TIERS__CPU__CAPACITY_BYTES": "128KiB",
        "TIERCACHE_TIERS__0__CAPACITY_BLOCKS": "32",
        "TIERCACHE_QUEUES__TRANSFER_CONCURRENCY": "3",
        "UNRELATED": "x",
    }
    config = load_config(write(tmp_path, GOOD), environ=environ)
    assert config.tiers[0].capacity_blocks == 32
    assert config.tiers[1].capacity_bytes == 128 * 1024
    assert config.queues.transfer_concurrency == 3


def test_bad_environment_override_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TIERCACHE_TIERS__DISK__CAPACITY_BLOCKS"):
        load_config(write(tmp_path, GOOD), environ={"TIERCACHE_TIERS__DISK__CAPACITY_BLOCKS": "3"})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity_blocks"):
        load_config(write(tmp_path, GOOD), environ={"TIERCACHE_TIERS__GPU__CAPACITY_BLOCKS": "lots"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GiB", 4 * 2**30), ("512 MB", 512 * 10**6), (1024, 1024), ("1.5KiB", 1536), ("7", 7)],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


def test_config_from_dict_reports_dict_source() -> None:
    with pytest.raises(ConfigError, match=r"^<dict>: layout"):
        config_from_dict(mutated(lambda d: d.pop("layout")), environ={})


def test_importing_the_config_imports_neither_torch_nor_the_tier_and_policy_registries() -> None:
    """Config checks are light: a tool that only validates topologies never pays for torch or the tiers."""
    import subprocess
    import sys

    script = (
        "import sys, tiercache.config, tiercache.common.fields\n"
        "heavy = [m for m in ('torch', 'tiercache.tiers', 'tiercache.policies') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"import tiercache.config imported {result.stdout.strip()}"


def test_redis_rules_live_with_the_redis_tier() -> None:
    """The core's validation helpers know nothing of Redis; the Redis tier's options module holds its rules."""
    import tiercache.common.fields as core_checks
    from tiercache.tiers.redis import options as redis_options

    assert not [name for name in vars(core_checks) if "redis" in name.lower()]
    assert callable(redis_options.redis_url)
