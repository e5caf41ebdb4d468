"""Every code block of README.md and docs/*.md, run as written here or marked as run elsewhere or not at all.

Each fenced block follows an HTML comment (invisible on GitHub) that says what happens to it:

- ``<!-- example: NAME -->``: run by the test here that asks for ``example("NAME")``: Python is
  executed, YAML is loaded (and validated) as a topology, a ``bash`` block of ``tiercache`` commands
  is run line by line with the installed command.
- ``<!-- engine: vllm -->`` / ``<!-- engine: vllm-connector -->`` / ``<!-- engine: sglang -->``: an
  engine's configuration, run by that engine's suite in its own venv (vLLM 0.33's offloading tiers,
  tiercache's KV connector under ``vllm serve`` of vLLM's CPU build, SGLang), which reads the blocks
  from docs/engines.md (the connector's suite from README.md); a copy in README.md must equal one of
  them. Here each configuration must parse as JSON, and the connector's topologies load.
- ``<!-- not run: WHY -->``: shown, not run (an install command, a transcript, the test script).

A block without such a mark, an indented (unfenced) code block, an example no test here asks for, and
a link out of the repository all fail.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.doc_pages import BLOCKS, ENGINE_CONFIGS, ENGINE_PAGE, LINK, PAGES, REPO, example, load_topology, parse, run
from support.doc_references import anchors, missing_paths_and_names, names_something

from tiercache.config import config_from_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the mechanism ---------------------------------------------------------------------------------------


def test_every_code_block_is_fenced_and_marked() -> None:
    problems = [problem for path in PAGES for problem in parse(path)[1]]
    problems += [f"{b.where}: a ```{b.lang} block without a mark before it" for b in BLOCKS if not b.kind]
    problems += [
        f"{b.where}: 'engine: {b.label}' names no engine suite"
        for b in BLOCKS
        if b.kind == "engine" and b.label not in ENGINE_CONFIGS
    ]
    assert not problems, "\n".join(problems)


def test_every_example_is_run_by_a_test_here() -> None:
    """The examples in the pages are exactly the names the docs tests ask for, each marked once."""
    marked = [block.label for block in BLOCKS if block.kind == "example"]
    tests = Path(__file__).parent.glob("test_*.py")
    asked = {name for test in tests for name in re.findall(r"""(?:example|run)\("([a-z0-9-]+)"\)""", test.read_text())}
    assert len(marked) == len(set(marked)), f"an example name is used twice: {sorted(marked)}"
    assert set(marked) == asked, f"marked but not run: {set(marked) - asked}; run but not marked: {asked - set(marked)}"


def test_engine_blocks_are_the_ones_the_engine_suites_run() -> None:
    """docs/engines.md holds every engine configuration (the engine venvs run those); README's are copies."""
    page = ENGINE_PAGE.relative_to(REPO).as_posix()
    text = ENGINE_PAGE.read_text()
    for engine, (pattern, count, marked) in ENGINE_CONFIGS.items():
        blocks = [b for b in BLOCKS if b.kind == "engine" and b.label == engine]
        served = [b.text for b in blocks if b.page == page]
        assert len(served) == marked, f"{page} has {len(served)} {engine} blocks; its suite runs {marked}"
        configs = re.findall(pattern, text, flags=re.DOTALL)
        assert len(configs) == count, f"{engine}'s pattern finds {len(configs)} configurations in {page}"
        assert sorted(configs) == sorted(c for t in served for c in re.findall(pattern, t, flags=re.DOTALL))
        for config in configs:
            json.loads(config)
        for copy in (b for b in blocks if b.page != page):
            assert copy.text in served, f"{copy.where}: not a copy of a {engine} block of {page}"


def test_links_stay_in_the_repository_and_resolve() -> None:
    problems = []
    for path in PAGES:
        for target in LINK.findall(path.read_text()):
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if "://" in target or target.startswith("mailto:"):
                problems.append(f"{path.name}: {target} leaves the repository")
            elif not resolved.is_relative_to(REPO) or not resolved.exists():
                problems.append(f"{path.name}: {target} is not a file of the repository")
            elif anchor and anchor not in anchors(resolved):
                problems.append(f"{path.name}: {target} names no heading of {resolved.name}")
    assert not problems, "\n".join(problems)


def test_paths_and_module_names_in_the_pages_exist() -> None:
    """A file, folder or module the pages name is in this checkout (so a move shows up here)."""
    problems = [f"{path.name}: {problem}" for path in PAGES for problem in missing_paths_and_names(path.read_text())]
    assert not problems, "\n".join(problems)


# ---- README.md --------------------------------------------------------------------------------------------


def test_embedding_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    namespace = run("embedding")
    assert namespace["cached"] == 0  # a fresh cache: nothing reused, every token computed
    assert len(namespace["ids"]) == -(-len(namespace["prompt_tokens"]) // namespace["mgr"].block_size)


def test_transformers_example(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)
    again = run("transformers")["again"]
    assert again.reused == {"gpu": 64, "cpu": 0} and again.computed_tokens == 8
    assert capsys.readouterr().out.strip() == "{'gpu': 64, 'cpu': 0} computed 8"


# ---- docs/embedding.md: RemoteStore -----------------------------------------------------------------------


def test_remote_store_example(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against the test's server, through the override a deployment would use."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TIERCACHE_TIERS__REDIS__OPTIONS__URL", redis_server.url)
    run("remote-store")
    assert capsys.readouterr().out.splitlines() == ["[True, True]", "['HELD', 'HELD']", "[True, True]"]


# ---- docs/engines.md --------------------------------------------------------------------------------------


def test_transformers_chat_example(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)
    turn = run("transformers-chat")["turn"]
    assert turn.released and turn.stored is not None
    assert turn.cached_tokens > 0 and turn.reused["gpu"] == turn.cached_tokens
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype='float16'")
    assert printed[2] == "{'gpu': 80, 'cpu': 0} computed 32"  # what the example's comment says


def test_transformers_hybrid_example(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)
    turn = run("transformers-hybrid")["turn"]
    assert turn.state.restored_tokens == turn.cached_tokens == turn.reused["gpu"] == 80
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype='float16'")
    assert printed[2] == "{'gpu': 80, 'cpu': 0} computed 32"  # what the example's comment says


CONNECTOR_SERVER = "redis://127.0.0.1:6379"
"""The address README's connector lines give the (central) Redis server."""


def connector_configs() -> dict[str, dict[str, Any]]:
    """README's three connector lines, by the remote below the CPU tier ("" for none)."""
    pattern = ENGINE_CONFIGS["vllm-connector"][0]
    configs = [json.loads(c) for c in re.findall(pattern, (REPO / "README.md").read_text(), flags=re.DOTALL)]
    by_remote = {"".join(t["type"] for t in c["kv_connector_extra_config"]["topology"]["tiers"][1:]): c
                 for c in configs}
    assert len(configs) == len(by_remote) == 3, f"README's connector lines: {configs}"
    return by_remote


def test_the_connector_lines_load_as_the_connector_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each line names the connector, recomputes failed loads, and its topology is valid under an engine's pool
    (the layout and model id vLLM supplies, a made-up one here; the host's memory is the server's to check)."""
    monkeypatch.setattr("tiercache.config.checks.host_memory_available", lambda: 1 << 40)
    configs = connector_configs()
    assert set(configs) == {"", "redis", "regional"}
    layout = {"num_layers": 8, "num_kv_heads": 1, "head_dim": 512, "dtype": "uint8", "block_size": 32,
              "memory": "layer_major"}
    for remote, config in configs.items():
        extra = config.pop("kv_connector_extra_config")
        assert config == {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
        }
        assert names_something(f"{config['kv_connector_module_path']}.{config['kv_connector']}")
        assert extra.pop("force_latest", False) is (remote == "regional")
        assert set(extra) == {"topology"}
        topology = extra["topology"]
        loaded = config_from_dict({**topology, "model": {"id": "docs"}, "layout": layout}, engine_pool=True)
        assert [t.type for t in loaded.tiers] == ["cpu", *([remote] if remote else [])]
        assert loaded.tiers[0].capacity_bytes == 4 * 10**9
        if remote == "redis":
            assert loaded.tiers[1].options.url == CONNECTOR_SERVER
        if remote == "regional":
            options = loaded.tiers[1].options
            assert (options.central_url, options.region_url) == (CONNECTOR_SERVER, "redis://127.0.0.1:6380")


def test_the_connectors_python_form_is_the_redis_line() -> None:
    """``LLM(..., kv_transfer_config=KVTransferConfig(...))``: the same fields as README's Redis line."""
    (block,) = [b for b in BLOCKS if b.label == "vllm-connector" and b.lang == "python" and b.page == "README.md"]
    calls = [node for node in ast.walk(ast.parse(block.text))
             if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "KVTransferConfig"]
    (call,) = calls
    fields = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    assert fields == connector_configs()["redis"]


# ---- docs/topologies.md -----------------------------------------------------------------------------------


def test_complete_topology_and_each_remote_line_load() -> None:
    topology_data = yaml.safe_load(example("topology-redis"))
    config = load_topology(topology_data)
    assert [(t.name, t.type) for t in config.tiers] == [("gpu", "gpu"), ("cpu", "cpu"), ("redis", "redis")]
    assert config.tiers[2].options.url == "redis://10.0.0.5:6379"
    lines = yaml.safe_load(example("remote-tier-lines"))
    for line in lines:
        loaded = load_topology({**topology_data, "tiers": [*topology_data["tiers"][:2], line]})
        assert loaded.tiers[2].type == line["type"]
    both = load_topology({**topology_data, "tiers": [*topology_data["tiers"], *lines]})
    assert [t.name for t in both.tiers][2:] == ["redis", "cluster", "regional", "disk", "remote"]


def test_a_tier_with_a_codec_loads() -> None:
    topology_data = yaml.safe_load(example("topology-redis"))
    (line,) = yaml.safe_load(example("codec-tier"))
    config = load_topology({**topology_data, "tiers": [*topology_data["tiers"][:2], line]})
    codec = config.tiers[2].codec
    assert [level.value for level in codec.levels] == ["compact", "int8"]
    assert codec.adaptive and codec.chunk_blocks == 16


def test_fleet_sections_load() -> None:
    data = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    config = load_topology({**data, **yaml.safe_load(example("topology-fleet"))})
    assert config.events.enabled and config.events.endpoint == "tcp://*:5557"
    assert config.cost.enabled and config.cost.prefill_tokens_per_s == 20000
    assert config.mrc.enabled and config.mrc.max_samples == 16000


# ---- docs/operations.md -----------------------------------------------------------------------------------


def test_cli_example(redis_server: Any, tmp_path: Path) -> None:
    """Each line as a shell runs it, in a fresh directory with the repository's configs, against the test's
    Redis (and a file tier in the test's directory) through the documented environment overrides."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    environ = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    deployed = {  # configs/redis.yaml's tiers, pointed at this test's server and directory
        "TIERCACHE_TIERS__REDIS__OPTIONS__URL": redis_server.url,
        "TIERCACHE_TIERS__DISK__OPTIONS__PATH": str(tmp_path / "disk"),
    }
    outputs = {}
    for line in example("cli").splitlines():
        env = {**environ, **deployed} if "configs/redis.yaml" in line else environ
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        words = shlex.split(line.split("#")[0])
        outputs[" ".join(words[1:2] + [word for word in words if word == "--synthetic"])] = done.stdout
    assert re.search(r"same first token as a recompute in (\d+) of \1 turns", outputs["demo"]), outputs["demo"]
    assert re.search(r"reused \d+ \(gpu \d+, cpu \d+\)", outputs["demo"]), "no turn reused the CPU tier's blocks"
    assert "KV verified against recompute: OK" in outputs["demo --synthetic"]
    assert outputs["inspect"].count("reachable") == 2 and "UNREACHABLE" not in outputs["inspect"]
    assert (tmp_path / "out" / "tiny.json").exists() and "cached_blocks" in outputs["stats"]


def test_stats_server_example(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    run("stats-server")
    url, cached, first = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and cached == "4"
    assert first.startswith("# HELP tiercache_")


def test_host_server_example(capsys: pytest.CaptureFixture[str]) -> None:
    run("host-server")
    assert capsys.readouterr().out.splitlines() == ["['cpu', 'cpu', 'cpu', 'cpu'] True 4"]


def test_kv_events_example(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("msgspec")
    monkeypatch.chdir(REPO)
    run("kv-events")
    (printed,) = capsys.readouterr().out.splitlines()
    assert printed == "[('AllBlocksCleared', None), ('BlockStored', 'gpu'), ('BlockStored', 'cpu')]"


# ---- docs/extending.md ------------------------------------------------------------------------------------


def test_plugin_tier_loads_by_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outline, made ``mypkg.tiers``, and an LRU made ``mypkg.policies:Mine``, named by the topology."""
    from tiercache.policies.lru import LRUPolicy
    from tiercache.tiers.base import RemoteTier

    tiers, policies = types.ModuleType("mypkg.tiers"), types.ModuleType("mypkg.policies")
    for module in (types.ModuleType("mypkg"), tiers, policies):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(example("plugin-tier"), "<example plugin-tier>", "exec"), tiers.__dict__)
    policies.Mine = type("Mine", (LRUPolicy,), {"__module__": "mypkg.policies"})  # type: ignore[attr-defined]
    assert issubclass(tiers.S3Tier, RemoteTier) and not tiers.S3Tier.__abstractmethods__
    config = load_topology(yaml.safe_load(example("plugin-topology")))
    assert config.tiers[0].policy == "mypkg.policies:Mine"
    assert config.tiers[2].options == tiers.S3Options(bucket="kv-cache")


def test_keyed_policy_example_replays_a_trace() -> None:
    """S3-FIFO keeps "a" (requested again while in its small FIFO: promoted to main) and evicts "b"."""
    namespace = run("keyed-policy")
    assert list(namespace["cache"]) == ["c", "a"]  # the small FIFO, then the main one


def test_plugin_conformance_outline_is_a_suite() -> None:
    from tiercache.testing.conformance import CHECKS, RemoteTierContract

    namespace = run("plugin-conformance")
    namespace["S3Harness"]()  # every abstract method of StoreHarness is there
    assert issubclass(namespace["TestS3Tier"], RemoteTierContract)
    assert len([name for name in dir(namespace["TestS3Tier"]) if name.startswith("test_")]) == len(CHECKS)
