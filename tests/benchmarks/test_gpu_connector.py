"""The GPU check's CPU half (``benchmarks/gpu_connector.py --device cpu --quick``): it runs with torch alone, shows
every injected failure caught, and cannot pass while the path it checks is broken.

The script runs in a subprocess whose imports of vLLM, xxhash, Redis and YAML
fail (what the GPU machine lacks); then again with one part of the connector
broken on purpose (a refused registration's error left set, a closed engine's
registrations left in place): the check must then fail, naming what broke.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.benchmark_runs import BENCHMARKS, HANG_GUARD_S

ABSENT = ("vllm", "xxhash", "redis", "yaml")
"""What the GPU machine does not have."""
RUN = """
import importlib.abc, runpy, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"no module named {{name!r}} on the GPU machine")
sys.meta_path.insert(0, Absent())
sys.path.insert(0, {benchmarks!r})
{breakage}
sys.argv = ["gpu_connector.py", "--device", "cpu", "--quick", "--out", {out!r}, *{extra!r}]
runpy.run_path({script!r}, run_name="__main__")
"""
BREAKAGES = {
    "a refused registration: pageable, its error cleared, a launch works":
        "from tiercache.integrations.vllm.connector import pinning; pinning._clear = lambda runtime: None",
    "every engine pinned (closed engines unregistered)":
        "from tiercache.integrations.vllm.connector import pinning; pinning.HostPins.close = lambda self: None",
    "worker in vLLM's speculative order: the forward reads what the store's forward wrote":
        "from tiercache.integrations.vllm.connector import worker; worker.group_copies = lambda job, groups: {}",
    "worker in vLLM's speculative order: a failed load's blocks are errors in its step":
        "from tiercache.integrations.vllm.connector import worker; worker.ConnectorWorker.take_load_errors = "
        "lambda self: set()",
}
"""A check, and a way to break what it checks."""


def run_check(tmp_path: Path, breakage: str = "", extra: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    code = RUN.format(absent=ABSENT, benchmarks=str(BENCHMARKS), breakage=breakage, out=str(tmp_path),
                      script=str(BENCHMARKS / "gpu_connector.py"), extra=list(extra))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    document = json.loads((tmp_path / "gpu_connector.json").read_text())
    return done.returncode, document, done.stdout + done.stderr


def test_the_cpu_half_runs_with_torch_alone_and_catches_every_injected_failure(tmp_path: Path) -> None:
    code, document, output = run_check(tmp_path)
    assert code == 0 and document["passed"], output[-4000:]
    assert set(document["injected"]) == {"failing device_to_host copy", "failing host_to_device copy",
                                         "region larger than its directory's room"}
    assert all(result["caught"] for result in document["injected"].values())
    assert document["layouts"]["pairs"] == 36 and document["tp2"]["scopes"] == ["SHARES", "SHARES"]
    assert document["hybrid"]["load_failed_at_once"] == [4] and document["hybrid"]["reported_while_in_flight"] == []
    assert len(document["rows"]) == 12 and all(row["jobs_ok"] for row in document["rows"])
    assert "PASS  injected: failing device_to_host copy" in output
    for order in ("v1", "speculative"):  # the connector's worker itself, in vLLM's call orders
        assert document["worker_order"][order] == {"pages_equal": True, "errors_in_step": [30, 31],
                                                   "done": {"1": 1, "2": 1}, "failed": {"3": 1}}
    assert not list(Path("/dev/shm").glob("tiercache-gpu-check-*")), "its regions removed"


@pytest.mark.parametrize("broken", sorted(BREAKAGES))
def test_the_check_fails_while_what_it_checks_is_broken(tmp_path: Path, broken: str) -> None:
    code, document, output = run_check(tmp_path, BREAKAGES[broken])
    assert code == 1 and document["passed"] is False
    assert document["checks"][broken] is False, output[-4000:]
    assert f"FAIL  {broken}" in output


CPU_SHOWN = {"2d-runs": "a run of whole slots past the maximum pitch, both ways"}
"""The script's ``--break`` guards a CPU run can show (``gpu_connector_breaks.CPU_SHOWN``), and the check that then
fails; the others need streams (a GPU run)."""


@pytest.mark.parametrize("broken", sorted(CPU_SHOWN))
def test_a_guard_broken_with_break_fails_the_check_where_a_cpu_can_show_it(tmp_path: Path, broken: str) -> None:
    code, document, output = run_check(tmp_path, extra=("--break", broken))
    assert code == 1 and not document["passed"] and document["broken"] == broken, output[-4000:]
    assert [name for name, passed in document["checks"].items() if not passed] == [CPU_SHOWN[broken]]
