"""The host server's fixtures: a short socket path (a Unix socket's is at most 107 bytes), clients closed after."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.host.client import HostTiers
from tiercache.host.server import HostServer


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="tch-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def opened() -> Iterator[list[HostTiers]]:
    clients: list[HostTiers] = []
    yield clients
    for tiers in clients:
        tiers.close()


@pytest.fixture
def servers() -> Iterator[list[HostServer]]:
    started: list[HostServer] = []
    yield started
    for server in started:
        server.close()
