"""SGLang 0.5.23's tests, run in .venv-sglang with ``TC_TEST_ENGINE=sglang`` (``scripts/test.sh``).

SGLang's import-time warnings on a CPU-only machine are expected there and hidden; nothing else is.
"""

from __future__ import annotations

import pytest

EXPECTED_WARNINGS = (
    # torchvision 0.16.2's compiled image and detection ops do not load next to the CPU torch 2.13 (unused).
    "ignore:Failed to load image Python extension:UserWarning",
    # SGLang's quantization modules say they need CUDA (unused).
    "ignore:Only CUDA:UserWarning",
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in EXPECTED_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
