"""Engine tests: transformers/ runs in the main suite; vllm/ and sglang/ only in their engine's own venv.

``scripts/test.sh`` runs the main suite (which collects neither), then each
engine's tests in the venv its set-up made, with ``TC_TEST_ENGINE`` naming the
engine (``tests/engines/<engine>/``; not a ``TIERCACHE_*`` name, since those
override topology fields). Without it neither is collected; with it, that
engine's tests must import their engine or fail: never a skip.
"""

from __future__ import annotations

import os

ENGINE_VARIABLE = "TC_TEST_ENGINE"
OWN_VENV_ENGINES = ("vllm", "sglang", "vllm_serve")
"""The engines whose tests need the engine's own venv (``.venv-<engine>``)."""

_selected = os.environ.get(ENGINE_VARIABLE)
collect_ignore = [engine for engine in OWN_VENV_ENGINES if engine != _selected]
