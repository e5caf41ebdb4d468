"""Shared by the benchmark scripts: their common options, the machine description and writing the JSON result.

Each benchmark runs as a script, ``python benchmarks/NAME.py``: Python puts this
folder first on ``sys.path``, so ``from common import ...`` resolves with no path
edits. What benchmarks share with the tests (Redis servers, traces, libCacheSim's
reference, the engines' parts) comes from ``tiercache.testing``, never from ``tests/``.

Every benchmark takes ``--quick`` (tiny sizes, one round, seconds: the test suite
runs it so that the scripts keep working; its figures mean nothing) and ``--out``
(where the JSON goes; by default next to the script, where the committed results live).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

QUICK_HELP = "a smoke run in seconds (tiny sizes, one round): it shows the script runs; its figures mean nothing"
OUT_HELP = "the JSON file to write, or a folder to write it in (default: next to the script)"


def arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes: ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, **quick: Any) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick``, ``quick`` are the defaults of those options (given ones still win)."""
    args = parser.parse_args(argv)
    if args.quick and quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args


def result_path(script: str, out: Path | None = None, name: str | None = None) -> Path:
    """Where a result goes: ``out`` (a file, or a folder to put ``name`` in), else ``name`` next to ``script``;
    ``name`` defaults to ``<script>.json``."""
    default = Path(script).resolve().with_name(name or Path(script).with_suffix(".json").name)
    if out is None:
        return default
    return out / default.name if out.is_dir() else out


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` (the least disturbed by the machine)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def machine() -> dict[str, Any]:
    """Where the figures were taken (compare figures only within one machine and run)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def write_result(script: str, result: dict[str, Any], out: Path | None = None, quick: bool = False,
                 name: str | None = None) -> Path:
    """Write the result with the machine attached, and whether it was a ``--quick`` run (``result_path``; ``name``:
    another file name than the script's)."""
    path = result_path(script, out, name)
    path.write_text(json.dumps({"machine": machine(), "quick": quick, **result}, indent=2) + "\n")
    return path
