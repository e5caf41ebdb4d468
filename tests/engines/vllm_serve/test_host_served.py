"""``vllm serve`` on a host cache server: docs/engines.md's host line, over a real ``tiercache serve``.

The host server starts with a topology of tiers alone; the first instance to
attach gives it the tiny Llama's model and page format. That instance answers a
long prompt and stops; a new instance (the same line, the model copied
elsewhere: an engine restarted or replaced on the host) loads every reusable
block of it from the host server's CPU tier and answers as the baseline. When
both have stopped the server holds no engine and no lease.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.lower_tiers_helpers import until
from support.vllm_serving import BLOCK, PROMPTS, Counted, ask, reusable, serving

from tiercache.telemetry.stats_server import fetch_stats

REPO = Path(__file__).resolve().parents[3]
ENGINES = (REPO / "docs" / "engines.md").read_text()
DOCS_SOCKET = "/run/tiercache/host.sock"
HOST_TIERS = {"tiers": [{"type": "cpu", "capacity_bytes": "64MiB"}]}
START_S = 60.0
"""Bound on the host server's start and stop (hang detectors)."""


def host_line(socket_path: Path) -> dict[str, Any]:
    """docs/engines.md's host line, the socket being this test's server's."""
    (block,) = re.findall(r"<!-- engine: vllm-connector-host -->\n```bash\n(.*?)\n```", ENGINES, flags=re.DOTALL)
    (line,) = re.findall(r"--kv-transfer-config '(\{.*?\})'", block)
    config = json.loads(line)
    assert config["kv_connector_extra_config"] == {"host": DOCS_SOCKET}
    config["kv_connector_extra_config"]["host"] = str(socket_path)
    return config


class HostServer:
    """``tiercache serve`` in its own process, with its stats on a free port."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="tch-served-"))
        self.socket = self.directory / "host.sock"
        topology = self.directory / "host.yaml"
        topology.write_text(yaml.safe_dump(HOST_TIERS))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tiercache", "serve", "--config", str(topology), "--socket", str(self.socket),
             "--shared-dir", str(self.directory), "--stats-port", "0"], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        found = re.search(r"http://127\.0\.0\.1:\d+", self.process.stdout.readline())
        assert found is not None and "tiercache serve" in self.process.stdout.readline()
        self.url = found[0]

    def stats(self) -> dict[str, Any]:
        return fetch_stats(self.url)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=START_S)
        shutil.rmtree(self.directory, ignore_errors=True)
        return code


@pytest.fixture(scope="module")
def host() -> Iterator[HostServer]:
    server = HostServer()
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def first(model_dirs: dict[str, Path], logs: Path, baseline: dict[str, list[int]], host: HostServer
          ) -> dict[str, Any]:
    """The first instance on the host server: it answers long_a and stops."""
    line = host_line(host.socket)
    with serving(model_dirs["seed0"], logs / "host-first.log", kv_transfer_config=line) as server, \
            Counted(server) as seen:
        answer = ask(server, "long_a")
    blocks = reusable(len(PROMPTS["long_a"])) // BLOCK
    held = until(lambda: (cached := host.stats()["tiers"]["cpu"]["cached_blocks"]) >= blocks and cached)
    return {"answer": answer, "stored": seen.tiercache("stored_blocks"), "external": seen.external, "held": held}


def test_the_first_instance_answers_and_stores_into_the_host_tier(first, baseline):
    blocks = reusable(len(PROMPTS["long_a"])) // BLOCK
    assert first["answer"] == baseline["long_a"]
    assert first["external"] == 0, "the host tier was empty"
    assert first["stored"] >= blocks and first["held"] >= blocks


def test_a_restarted_instance_loads_from_the_host_tier(first, model_dirs, logs, baseline, host):
    blocks = reusable(len(PROMPTS["long_a"])) // BLOCK
    line = host_line(host.socket)
    with serving(model_dirs["copy"], logs / "host-second.log", kv_transfer_config=line) as server, \
            Counted(server) as seen:
        answer = ask(server, "long_a")
    assert answer == baseline["long_a"]
    assert (seen.external, seen.local) == (blocks * BLOCK, 0)
    assert seen.tiercache("hit_blocks", tier="cpu") == blocks
    assert seen.tiercache("failed_loads") == 0
    left = until(lambda: (stats := host.stats())["host"]["engines"] == 0 and not stats["host"]["leases"] and stats)
    assert held_slots(left) == 0, "no pin or write of a stopped instance is left"
    assert host.stop() == 0


def held_slots(stats: dict[str, Any]) -> int:
    cpu = stats["tiers"]["cpu"]
    return cpu["capacity_blocks"] - cpu["free_blocks"] - cpu["evictable_blocks"]
