"""README's three vLLM configurations, run as a user copies them (only the server addresses and
``cpu_bytes_to_use`` are replaced by the test's own): the JSON after ``--kv-transfer-config``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import tiercache.integrations.vllm as adapter
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_offloading import Engine, chunk_keys, offloading_config, payloads, wait_replicated

REPO = Path(__file__).resolve().parents[3]
CONFIGS = re.findall(
    r"--kv-transfer-config '(\{\s*\"kv_connector\": \"OffloadingConnector\".*?\})'",
    (REPO / "docs" / "engines.md").read_text(),
    flags=re.DOTALL,
)
"""The OffloadingConnector configurations (the page's TierCacheConnector lines are tests/engines/vllm_serve/'s)."""
README_CENTRAL, README_REGION = "redis://127.0.0.1:6379", "redis://127.0.0.1:6380"
COUNT = 4


def readme_config(marker: str, central: RedisServer, region: RedisServer | None = None) -> dict[str, Any]:
    """The one README configuration containing ``marker``, pointed at the test's servers."""
    (text,) = [config for config in CONFIGS if marker in config]
    if region is not None:
        text = text.replace(README_REGION, region.url)
    config = json.loads(text.replace(README_CENTRAL, central.url))
    assert config["kv_connector"] == "OffloadingConnector"
    extra = dict(config["kv_connector_extra_config"])
    del extra["cpu_bytes_to_use"]  # the test's own small CPU tier
    return extra


def engine(engines: list[Engine], extra: dict[str, Any]) -> Engine:
    built = Engine(offloading_config(extra=extra))
    engines.append(built)
    return built


def test_readme_has_the_three_configurations() -> None:
    assert len(CONFIGS) == 3


def test_the_redis_configuration_shares_chunks_between_instances(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    extra = readme_config('"type": "redis"', redis_server)
    writer = engine(engines, extra)
    keys = chunk_keys(COUNT, "readme")
    data = payloads(COUNT, writer.row_bytes, seed=11)
    writer.store(keys, data)
    writer.settle()
    assert engine(engines, extra).read(keys) == data


def test_the_regional_configuration_reads_the_latest_version(
    redis_factory, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the topology's path is relative to vLLM's working directory
    central, region = redis_factory(), redis_factory()
    extra = readme_config('"force_latest": true', central, region)
    writer = engine(engines, extra)
    keys = chunk_keys(COUNT, "readme-regional")
    data = payloads(COUNT, writer.row_bytes, seed=12)
    writer.store(keys, data)
    writer.settle()
    wait_replicated(writer, COUNT)  # another instance's force_latest read trusts central's versions only
    (tier,) = writer.tiers
    assert tier.force_latest
    assert engine(engines, extra).read(keys) == data


def test_the_s3fifo_configuration_puts_tiercaches_policy_under_vllms_cpu_tier(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    built = engine(engines, readme_config("TierCacheS3FIFO", redis_server))
    assert isinstance(built.primary._policy, adapter.TierCacheS3FIFO)
    keys = chunk_keys(COUNT, "readme-s3fifo")
    data = payloads(COUNT, built.row_bytes, seed=13)
    built.store(keys, data)
    assert built.read(keys) == data
