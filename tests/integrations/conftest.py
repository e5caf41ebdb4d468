"""Engine integration tests run in each engine's own venv, never in the main suite.

``scripts/test.sh`` runs the main suite (which collects nothing here), then each
engine's tests in the venv its set-up made, with ``TC_TEST_ENGINE`` naming the
engine (``tests/integrations/<engine>/``; not a ``TIERCACHE_*`` name, since those
override topology fields). Without it nothing here is collected; with it, that
engine's tests must import their engine or fail: never a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_VARIABLE = "TC_TEST_ENGINE"

_selected = os.environ.get(ENGINE_VARIABLE)
collect_ignore = [
    path.name for path in Path(__file__).parent.iterdir() if path.is_dir() and path.name != _selected
]
