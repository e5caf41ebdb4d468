"""Fixtures of the tier tests: the TLS tests' certificates."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.redis_tls import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A test CA, another CA, a server certificate for 127.0.0.1 and a client certificate (``make_pki``)."""
    return make_pki(tmp_path_factory.mktemp("pki"))
