"""Running a benchmark script's ``--quick`` mode from a test, and checking the shape of the JSON it wrote.

``run_quick(script, tmp_path)`` runs ``benchmarks/<script> --quick --out tmp_path`` with this
interpreter (the suite's venv), fails with the script's output if it exits non-zero, checks
that no committed result next to the scripts changed, and returns the JSON it wrote.
``assert_shape(document, template)`` checks keys and types only, never a figure: a dict
template names keys that must be there, ``[t]`` a non-empty list of ``t``, ``Each(t)`` a
non-empty dict of any keys whose values are ``t``, a type (or tuple of types) the value's type.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NUMBER = (int, float)
HANG_GUARD_S = 1800
"""Only so that a hung script cannot hold the suite forever; no test judges how long a run took."""
OUTPUT_TAIL = 4000


RESTART_RUN = {"restart_ms": NUMBER, "local_hit_ms": NUMBER, "recompute_ms": NUMBER,
               "restart_over_local": NUMBER, "restart_ttfts_ms": [NUMBER], "local_ttfts_ms": [NUMBER],
               "breakdown_per_request": {"lookup_us": NUMBER, "fetch_us": NUMBER, "load_copy_us": NUMBER},
               "external_tokens": NUMBER, "answers_equal": bool, "raw_read_ms": NUMBER, "raw_read_hot_ms": NUMBER,
               "floor_over_local": NUMBER}
"""One run of ``benchmarks/restart_rows.py`` (in ``vllm_serve.py``'s JSON and in its own)."""


@dataclass(frozen=True)
class Each:
    """A non-empty dict whose keys are free (a trace's or a configuration's name) and whose values match ``of``."""

    of: Any


def assert_shape(value: Any, template: Any, where: str = "$") -> None:
    """Fail, naming the path, where ``value`` lacks a key ``template`` names or has another type."""
    if isinstance(template, Each):
        assert isinstance(value, dict) and value, f"{where}: expected a non-empty object, got {value!r:.80}"
        for key, item in value.items():
            assert_shape(item, template.of, f"{where}[{key!r}]")
    elif isinstance(template, dict):
        assert isinstance(value, dict), f"{where}: expected an object, got {value!r:.80}"
        missing = sorted(set(template) - set(value))
        assert not missing, f"{where}: missing {missing}"
        for key, item in template.items():
            assert_shape(value[key], item, f"{where}.{key}")
    elif isinstance(template, list):
        assert isinstance(value, list) and value, f"{where}: expected a non-empty list, got {value!r:.80}"
        for index, item in enumerate(value):
            assert_shape(item, template[0], f"{where}[{index}]")
    else:
        assert isinstance(value, template), f"{where}: expected {template}, got {value!r:.80}"


def committed_results() -> dict[str, str]:
    """Digest of every result file next to the scripts (the figures of docs/benchmarks.md)."""
    files = [*BENCHMARKS.glob("*.json"), *BENCHMARKS.glob("*.png")]
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(files)}


def run_quick(script: str, out: Path, *extra: str) -> dict[str, Any]:
    """Run ``benchmarks/<script> --quick --out <out>`` (a folder) and return the JSON it wrote there."""
    before = committed_results()
    command = [sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    output = (done.stdout + done.stderr)[-OUTPUT_TAIL:]
    assert done.returncode == 0, f"{script} --quick exited {done.returncode}:\n{output}"
    assert committed_results() == before, f"{script} --quick changed a committed result in benchmarks/"
    written = out / Path(script).with_suffix(".json").name
    assert written.is_file(), f"{script} --quick wrote no {written.name} in --out:\n{output}"
    document = json.loads(written.read_text())
    assert_shape(document, {"machine": dict, "quick": bool})
    assert document["quick"] is True, f"{written.name} does not say it was a quick run"
    return document
