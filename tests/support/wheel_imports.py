"""Run by ``support.wheel.import_modules`` in a venv with the built wheel (standard library only).

``python -I wheel_imports.py OUT MODULE...`` imports each module and writes JSON to OUT: where each one
was loaded from or why it failed, where tiercache's distribution is installed, which engines import, and
every tiercache module loaded by then (with its file).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
import sysconfig
from pathlib import Path

ENGINES = ("vllm", "sglang")


def outcome(module: str) -> dict[str, object]:
    """``{"file": ...}`` for a module that imported; its exception's type, message and missing name if not."""
    try:
        return {"file": importlib.import_module(module).__file__}
    except Exception as error:  # reported, and judged by the test
        return {
            "error": type(error).__name__,
            "import_error": isinstance(error, ImportError),
            "missing": getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None,
            "message": str(error)[:500],
        }


def main(out: str, modules: list[str]) -> None:
    """Import ``modules`` in order and write the report to ``out``."""
    report = {
        "modules": {module: outcome(module) for module in modules},
        "site_packages": sysconfig.get_paths()["purelib"],
        "distribution": str(importlib.metadata.distribution("tiercache").locate_file("")),
        "engines": {engine: importlib.util.find_spec(engine) is not None for engine in ENGINES},
        "loaded": {name: getattr(module, "__file__", None) for name, module in sorted(sys.modules.items())
                   if name.split(".")[0] == "tiercache"},
        "sys_path": sys.path,
    }
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
