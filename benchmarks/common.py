"""Shared by the benchmark scripts: machine description and writing the JSON result.

Each benchmark runs as a script, ``python benchmarks/NAME.py``: Python puts this
folder first on ``sys.path``, so ``from common import ...`` resolves with no path
edits. What benchmarks share with the tests (Redis servers, traces, libCacheSim's
reference, the engines' parts) comes from ``tiercache.testing``, never from ``tests/``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch


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


def write_result(script: str, result: dict[str, Any]) -> Path:
    """Write ``<script>.json`` next to the script, with the machine attached."""
    path = Path(script).with_suffix(".json")
    path.write_text(json.dumps({"machine": machine(), **result}, indent=2) + "\n")
    return path
