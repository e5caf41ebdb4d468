"""``tiercache inspect`` names why a remote is unreachable, for every kind of remote (issue 20, item 13).

Each remote keeps its latest failure in ``last_error`` (the ``RemoteTier``
base); ``inspect`` prints it on the tier's UNREACHABLE line instead of only
"check write failed, read back failed".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tiercache.cli import EXIT_UNAVAILABLE, main

SMALL_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_size": 8}
FAST_REDIS = {"timeout_s": 0.5, "connect_timeout_s": 0.5}


def inspect(tmp_path: Path, remote: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``tiercache inspect`` on GPU + CPU + ``remote``; the remote's line (exit code checked)."""
    topology = {
        "model": {"id": "inspect-test"},
        "layout": SMALL_LAYOUT,
        "tiers": [
            {"name": "gpu", "type": "gpu", "capacity_blocks": 16, "options": {"device": "cpu"}},
            {"name": "cpu", "type": "cpu", "capacity_blocks": 32},
            remote,
        ],
    }
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    assert main(["inspect", "--config", str(path), "--timeout", "3"]) == EXIT_UNAVAILABLE
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(remote["name"])]
    assert len(lines) == 2, lines  # the capacity table's row and the connectivity row
    return lines[1]


def test_a_redis_tier_names_the_refused_connection(
    tmp_path: Path, refused_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = inspect(tmp_path, {"name": "redis", "type": "redis", "options": {"url": refused_url, **FAST_REDIS}}, capsys)
    assert "UNREACHABLE" in line and "Connection refused" in line, line


def test_a_redis_cluster_tier_names_the_refused_connection(
    tmp_path: Path, refused_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options = {"url": refused_url, "cluster": True, **FAST_REDIS}
    line = inspect(tmp_path, {"name": "cluster", "type": "redis", "options": options}, capsys)
    assert "UNREACHABLE" in line and "Connection refused" in line, line


def test_a_regional_tier_names_the_refused_connection(
    tmp_path: Path, refused_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options = {"central_url": refused_url, "mode": "central", **FAST_REDIS}
    line = inspect(tmp_path, {"name": "regional", "type": "regional", "options": options}, capsys)
    assert "UNREACHABLE" in line and "Connection refused" in line, line


def test_a_file_tier_names_the_directory_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the tier's directory should be")
    options = {"path": str(blocker / "tier"), "max_blocks": 64}
    line = inspect(tmp_path, {"name": "files", "type": "file", "options": options}, capsys)
    assert "UNREACHABLE" in line and "Not a directory" in line, line


def test_a_simulated_tier_names_its_outage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = {"latency_ms": 0, "down_windows_s": [[0, 3600]]}
    line = inspect(tmp_path, {"name": "sim", "type": "simulated", "options": options}, capsys)
    assert "UNREACHABLE" in line and "down" in line, line


def test_a_redis_tier_names_a_server_without_maxmemory(
    tmp_path: Path, redis_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    server = redis_factory(maxmemory="0")  # a plain `redis-server`, as a new user starts one
    line = inspect(tmp_path, {"name": "redis", "type": "redis", "options": {"url": server.url, **FAST_REDIS}}, capsys)
    assert "UNREACHABLE" in line and "no maxmemory" in line and "allow_unbounded" in line, line
