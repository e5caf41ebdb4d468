"""vLLM 0.33 tests: run by ``scripts/test.sh`` in ``.venv-vllm`` with ``TC_TEST_ENGINE=vllm``.

vLLM must import here (an ImportError fails the run, it never skips it); the
Redis fixtures come from ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import vllm  # noqa: F401  (the engine these tests exist for: a missing vLLM is an error)
from redis_servers import RedisServer
from vllm_engine import Engine

from tiercache.integrations.vllm import require_vllm

require_vllm()

LOOKUP_TIMEOUT_MS = 150


def redis_topology(server: RedisServer, **options: Any) -> dict[str, Any]:
    """A remote-only topology over one test server (short timeouts, so failures show quickly)."""
    return {
        "tiers": [
            {
                "name": "redis",
                "type": "redis",
                "options": {"url": server.url, "allow_unbounded": True, "timeout_s": 0.3, **options},
            }
        ],
        "queues": {"remote_lookup_timeout_ms": LOOKUP_TIMEOUT_MS},
    }


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test builds (append them); each is settled and shut down afterwards."""
    built: list[Engine] = []
    yield built
    for engine in built:
        engine.shutdown()
