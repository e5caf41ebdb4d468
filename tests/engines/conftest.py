"""Engine tests: transformers/ runs in the main suite; the others only in their engine's own venv.

``scripts/test.sh`` runs the main suite (which collects none of them), then
each engine's tests in the venv its set-up made, with ``TC_TEST_ENGINE`` naming
the folder (``tests/engines/<name>/``; not a ``TIERCACHE_*`` name, since those
override topology fields): ``vllm`` in ``.venv-vllm`` (vLLM 0.33's classes),
``vllm_serve`` in ``.venv-vllm-cpu`` (``vllm serve`` on vLLM's CPU build, with
tiercache's connector), ``sglang`` in ``.venv-sglang``. Without it none is
collected; with it, that folder's tests must import their engine or fail:
never a skip.
"""

from __future__ import annotations

import os

ENGINE_VARIABLE = "TC_TEST_ENGINE"
OWN_VENV_ENGINES = ("vllm", "vllm_serve", "sglang")
"""The folders whose tests need an engine's own venv."""

_selected = os.environ.get(ENGINE_VARIABLE)
collect_ignore = [engine for engine in OWN_VENV_ENGINES if engine != _selected]
