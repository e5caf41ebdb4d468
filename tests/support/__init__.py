"""The test suite's helpers, in one place, imported as ``support.<module>`` by every test.

pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml). A helper
that runs as a child process is started with ``module_command`` and the
environment of ``with_tests_on_path``, so it imports the same way there. Fixtures stay
in the conftest files; what benchmarks share with the tests is in ``tiercache.testing``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
"""The tests/ folder."""
REPO = TESTS.parent
"""The repository's root (configs/, examples/, README.md)."""


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``support.<module>`` as a script: ``python -m support.<module> ARGS``."""
    return [sys.executable, "-m", f"support.{module}", *args]


def with_tests_on_path() -> dict[str, str]:
    """This environment with tests/ first on PYTHONPATH (keeping what the caller had there)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
