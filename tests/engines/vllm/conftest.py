"""vLLM 0.33 tests: run by ``scripts/test.sh`` in ``.venv-vllm`` with ``TC_TEST_ENGINE=vllm``.

vLLM must import here (an ImportError fails the run, it never skips it); the
Redis fixtures come from ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.vllm_connector import Instances  # imports vLLM: a missing vLLM is an error here

from tiercache.integrations.vllm import require_vllm
from tiercache.testing.vllm_offloading import Engine

require_vllm()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test builds (append them); each is shut down afterwards, whatever the test did."""
    built: list[Engine] = []
    yield built
    for engine in built:
        engine.shutdown()


@pytest.fixture
def vllm(tmp_path: Path) -> Iterator[Instances]:
    """Connector instances a test builds (``vllm.new``); each is closed afterwards."""
    made = Instances(tmp_path)
    yield made
    made.close()
