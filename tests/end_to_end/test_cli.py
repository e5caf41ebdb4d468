"""The ``tiercache`` command: demo, simulate, inspect, stats, tables; and the simulation core."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from tiercache import cli
from tiercache.blocks.layout import KVLayout
from tiercache.cli import main
from tiercache.config import ConfigError, config_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.telemetry.stats_server import StatsServer, fetch_stats
from tiercache.tools.simulate import (
    PRESETS,
    Progress,
    SessionWorkload,
    load_workload,
    simulate,
    timed_requests,
)
from tiercache.tools.workload import ChatWorkload

SMALL_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_size": 8}
PREFILL_S_PER_TOKEN = 0.001


def small_topology(gpu_blocks: int = 64, remote: dict[str, Any] | None = None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"name": "gpu", "type": "gpu", "capacity_blocks": gpu_blocks, "options": {"device": "cpu"}},
        {"name": "cpu", "type": "cpu", "capacity_blocks": 512},
    ]
    return {"model": {"id": "cli-test"}, "layout": SMALL_LAYOUT, "tiers": tiers + ([remote] if remote else [])}


def write_yaml(path: Path, data: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_demo_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--synthetic", "--users", "2", "--rounds", "2"]) == 0
    assert "KV verified against recompute: OK" in capsys.readouterr().out


def test_timed_requests_interleave_sessions_in_arrival_order() -> None:
    workload = SessionWorkload(ChatWorkload(users=3, rounds=3, document_every=4), think_time_s=5.0)
    requests = timed_requests(workload)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert sum(r.user == -1 for r in requests) == 2
    assert len(requests) == 3 * 3 + 2
    by_user: dict[int, list[int]] = {}
    for request in requests:
        if request.user >= 0:
            by_user.setdefault(request.user, []).append(len(request.tokens))
    assert all(lengths == sorted(lengths) for lengths in by_user.values())
    assert [r.arrival_s for r in timed_requests(workload)] == arrivals


def test_load_workload_preset_file_and_errors(tmp_path: Path) -> None:
    assert load_workload("tiny") is PRESETS["tiny"]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"users": 3, "rounds": 2, "think_time_s": 1.5}))
    workload = load_workload(str(path))
    assert workload.chat.users == 3 and workload.think_time_s == 1.5
    path.write_text(yaml.safe_dump({"userz": 3}))
    with pytest.raises(ConfigError, match="userz"):
        load_workload(str(path))
    with pytest.raises(ConfigError, match="preset"):
        load_workload(str(tmp_path / "missing.yaml"))


def test_simulate_accounts_reuse_and_models_ttft() -> None:
    workload = SessionWorkload(ChatWorkload(users=3, rounds=3, system_tokens=64, user_tokens=16, reply_tokens=16))
    requests = timed_requests(workload)
    config = config_from_dict(small_topology(gpu_blocks=24), environ={})
    with TierManager(config) as manager:
        result = simulate(manager, requests, name="t", prefill_s_per_token=PREFILL_S_PER_TOKEN)
    totals = result.totals()
    assert result.mismatched_blocks == 0
    assert totals["requests"] == len(requests)
    assert totals["prompt_tokens"] == sum(len(r.tokens) for r in requests)
    assert totals["reused_tokens"]["cpu"] > 0, "a 24-block GPU pool must evict, and later rounds hit the CPU tier"
    for record in result.records:
        assert record.computed_tokens + sum(record.reused.values()) == record.prompt_tokens
        loaded = sum(n for tier, n in record.reused.items() if tier != "gpu")
        expected = record.computed_tokens * PREFILL_S_PER_TOKEN + loaded / 8 * result.transfer_s_per_block["cpu"]
        assert record.ttft_s == pytest.approx(expected)
    series = result.hit_ratio_over_time(bins=4)
    assert len(series["window_end_s"]) == 4
    assert all(0.0 <= share <= 1.0 for values in series["share"].values() for share in values)


def test_simulate_command_writes_json_stats_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_yaml(tmp_path / "topo.yaml", small_topology())
    out = tmp_path / "out" / "run"
    stats_out = tmp_path / "stats.json"
    code = main(
        ["simulate", "--config", config, "--workload", "tiny", "--out", str(out), "--stats-out", str(stats_out)]
    )
    assert code == 0
    printed = capsys.readouterr()
    assert "reuse gpu" in printed.out and "saved" in printed.out
    assert "[" in printed.err and "]" in printed.err
    document = json.loads(out.with_suffix(".json").read_text())
    run = document["runs"][0]
    assert run["totals"]["requests"] + run["totals"]["rejected"] == len(timed_requests(PRESETS["tiny"]))
    assert run["totals"]["rejected"] == 1, "the 2048-token document does not fit a 64-block pool of 8-token blocks"
    assert run["totals"]["mismatched_blocks"] == 0
    pytest.importorskip("matplotlib", reason="the PNG plots need the bench extra")
    assert (tmp_path / "out" / "run_hit_ratio.png").stat().st_size > 0
    assert (tmp_path / "out" / "run_ttft.png").stat().st_size > 0
    assert main(["stats", "--file", str(stats_out)]) == 0
    assert "stored_blocks" in capsys.readouterr().out


def test_progress_bar_plain_text() -> None:
    stream = io.StringIO()
    progress = Progress(10, "run", stream)
    for done in range(1, 11):
        progress.update(done)
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("run [" + "#" * 30 + "] 10/10")
    assert 1 < len(lines) <= 10


def test_inspect_reports_capacities_and_reachable_remote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    remote = {"name": "sim", "type": "simulated", "options": {"latency_ms": 0.1, "capacity_blocks": 100}}
    config = write_yaml(tmp_path / "topo.yaml", small_topology(remote=remote))
    assert main(["inspect", "--config", config]) == 0
    out = capsys.readouterr().out
    block_bytes = 2 * 2 * 8 * 2 * 16 * 2
    assert f"{block_bytes} bytes per block" in out
    assert "64 blocks" in out and "100 blocks" in out
    assert "sim" in out and "reachable" in out and "UNREACHABLE" not in out


def test_inspect_reports_unreachable_remote_without_raising(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    remote = {"name": "sim", "type": "simulated", "options": {"error_rate": 1.0}}
    config = write_yaml(tmp_path / "topo.yaml", small_topology(remote=remote))
    assert main(["inspect", "--config", config, "--timeout", "1"]) == 3
    assert "UNREACHABLE" in capsys.readouterr().out


def test_inspect_bad_config_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = small_topology()
    data["tiers"][0]["capacity_blocks"] = -1
    assert main(["inspect", "--config", write_yaml(tmp_path / "bad.yaml", data)]) == 2
    assert "tiers[0].capacity_blocks" in capsys.readouterr().err


def test_stats_from_a_running_server(capsys: pytest.CaptureFixture[str]) -> None:
    config = config_from_dict(small_topology(), environ={})
    with TierManager(config) as manager, StatsServer(manager.stats, manager.parts.metrics) as server:
        manager.lookup(list(range(32)))
        assert main(["stats", "--url", server.url]) == 0
        assert "lookups" in capsys.readouterr().out
        assert main(["stats", "--url", server.url, "--prometheus"]) == 0
        assert 'tiercache_tier_lookups_total{tier="all"} 1.0' in capsys.readouterr().out
    assert main(["stats", "--url", server.url, "--timeout", "1"]) == 3


@pytest.mark.parametrize(
    ("content", "cause"),
    [(None, "No such file"), ("{not json", "not JSON"), ("[1, 2]", "not a stats mapping")],
)
def test_stats_from_a_file_it_cannot_use_names_the_file_and_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, cause: str
) -> None:
    path = tmp_path / "stats.json"
    if content is not None:
        path.write_text(content)
    assert main(["stats", "--file", str(path)]) == 3
    err = capsys.readouterr().err
    assert str(path) in err and cause in err, err


def test_simulate_serves_stats_from_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``simulate --stats-port P &`` then ``stats --url``: the server is up before the (slow) prefill measurement."""
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    seen: list[dict[str, Any]] = []

    def measure_while_serving(layout: Any) -> float:
        seen.append(fetch_stats(f"http://127.0.0.1:{port}", timeout=5))
        return PREFILL_S_PER_TOKEN

    monkeypatch.setattr(cli, "measure_prefill_cost", measure_while_serving)
    config = write_yaml(tmp_path / "topo.yaml", small_topology())
    out = str(tmp_path / "run")
    args = ["simulate", "--config", config, "--workload", "tiny", "--out", out, "--no-plots", "--stats-port", str(port)]
    assert main(args) == 0
    assert len(seen) == 1 and "gpu" in seen[0]["tiers"]


def test_inspect_keeps_columns_apart_for_a_plugin_tier_and_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = {
        "name": "a-long-tier-name",
        "type": "support.plugin_tier:DictTier",
        "policy": "support.plugin_policy:FifoPolicy",
    }
    config = write_yaml(tmp_path / "topo.yaml", small_topology(remote=remote))
    assert main(["inspect", "--config", config]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("a-long-tier-name"))
    columns = ["a-long-tier-name", "support.plugin_tier:DictTier", "support.plugin_policy:FifoPolicy", "write_through"]
    assert row.split()[:4] == columns


def test_tables_learns_a_models_compact_tables_a_topology_then_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from tiercache.codecs.coding import KVCoding
    from tiercache.codecs.geometry import KVGeometry
    from tiercache.codecs.levels import Level
    from tiercache.codecs.tables import load_tables
    from tiercache.testing.real_model import build_smollm2

    out = tmp_path / "smollm2.bin"  # a name not ending in .npz is written as given, as a topology names it
    assert main(["tables", str(build_smollm2()), "--out", str(out), "--contexts", "2", "--tokens", "64"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == [out.name]
    tables = load_tables(out)
    assert (tables.layers, tables.channels) == (30, 3 * 64), "SmolLM2: 30 layers, 3 KV heads of 64"
    assert f"{out}: tables for 30 layers x 192 channels (digest {tables.digest.hex()})" in capsys.readouterr().out
    layout = KVLayout(30, 3, 64, "float16", 16)
    assert KVCoding(KVGeometry.of(layout), [Level.COMPACT], tables).compact is not None
    assert main(["tables", str(tmp_path / "no-model"), "--out", str(tmp_path / "x.npz")]) == 3
    assert "tiercache tables:" in capsys.readouterr().err and not (tmp_path / "x.npz").exists()
