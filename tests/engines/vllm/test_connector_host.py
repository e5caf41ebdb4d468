"""The connector on a host cache server (the ``host`` option), driven by vLLM 0.33's own scheduler.

A ``HostServer`` in this process, with a topology of tiers alone, serves every
instance; each instance's scheduler side attaches over the socket and its
worker maps the server's region. Pages are checked bit for bit against the
"model" (``support.vllm_connector``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.lower_tiers_helpers import until
from support.vllm_connector import PROMPT, Instance, Instances, request, tiers_of, totals
from support.vllm_parts import BLOCK

from tiercache.config import ConfigError
from tiercache.host.server import HostServer
from tiercache.integrations.vllm.connector.options import ConnectorOptions

HOST_TIERS = {"tiers": [{"type": "cpu", "capacity_blocks": 64}]}


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="tch-vllm-"))  # a Unix socket's path is short
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def host(socket_dir: Path) -> Iterator[HostServer]:
    server = HostServer(HOST_TIERS, socket_dir / "host.sock", shared_dir=socket_dir).start()
    yield server
    server.close()


def on_host(vllm: Instances, name: str, socket: Path) -> Instance:
    return vllm.new(name, {}, options={"host": str(socket)})


def held(server: HostServer) -> int:
    assert server.tiers is not None
    cpu = server.tiers.stats()["tiers"]["cpu"]
    return cpu["capacity_blocks"] - cpu["free_blocks"] - cpu["evictable_blocks"]


def test_the_host_option_takes_no_tiers_of_its_own() -> None:
    assert ConnectorOptions.parse({"host": "/run/tiercache/host.sock"}).host == Path("/run/tiercache/host.sock")
    with pytest.raises(ConfigError, match="tiers"):
        ConnectorOptions.parse({"host": "/run/h.sock", "topology": {"tiers": [{"type": "cpu"}]}})
    with pytest.raises(ConfigError, match="host"):
        ConnectorOptions.parse({"host": ""})


def test_a_second_instance_loads_what_the_first_stored_bit_exact(vllm: Instances, host: HostServer) -> None:
    first = on_host(vllm, "first", host.socket_path)
    assert totals(first.serve(request("a", PROMPT)))["stored_blocks"] == 6
    assert host.region is not None and host.tiers is not None, "the first instance gave the server its pages"
    second = on_host(vllm, "second", host.socket_path)
    records = second.serve(request("b", PROMPT))
    assert sum(record.external_hits for record in records) == 6 * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]
    counts = totals(records)
    assert counts["loaded_blocks"] == 6 and counts["hit_blocks:cpu"] == 6
    assert counts.get("failed_loads", 0) == 0 and counts.get("stored_blocks", 0) == 0, "held once"
    until(lambda: held(host) == 0)


def test_no_host_server_yet_serves_on_misses_then_attaches(vllm: Instances, socket_dir: Path) -> None:
    socket = socket_dir / "host.sock"
    early = on_host(vllm, "early", socket)
    records = early.serve(request("a", PROMPT))
    assert not [wrong for record in records for wrong in record.wrong_pages]
    assert totals(records).get("stored_blocks", 0) == 0, "nowhere to store"
    server = HostServer(HOST_TIERS, socket, shared_dir=socket_dir).start()
    try:
        until(lambda: tiers_of(early).attached)
        stored = early.serve(request("b", PROMPT[:4 * BLOCK] + [7] * (3 * BLOCK)))
        assert totals(stored)["stored_blocks"] > 0, "the worker mapped the region once the server answered"
        again = on_host(vllm, "again", socket).serve(request("c", PROMPT[:4 * BLOCK] + [7] * (3 * BLOCK)))
        assert sum(record.external_hits for record in again) == 6 * BLOCK
        assert not [wrong for record in again for wrong in record.wrong_pages]
    finally:
        server.close()


def test_jobs_of_a_restarted_server_s_region_are_failed_never_copied(
        vllm: Instances, host: HostServer, socket_dir: Path) -> None:
    stays = on_host(vllm, "stays", host.socket_path)
    stays.serve(request("warm", list(range(400, 440))))  # its worker maps the first server's region
    host.close()
    restarted = HostServer(HOST_TIERS, host.socket_path, shared_dir=socket_dir).start()
    try:
        other = on_host(vllm, "other", restarted.socket_path)
        assert totals(other.serve(request("a", PROMPT)))["stored_blocks"] == 6
        tiers = tiers_of(stays)
        tiers.lookup([b"x" * 16])  # finds the first server gone
        until(lambda: tiers.attached)
        records = stays.serve(request("b", PROMPT))
        assert not [wrong for record in records for wrong in record.wrong_pages], "recomputed, never copied"
        counts = totals(records)
        assert counts.get("failed_loads", 0) + counts.get("failed_stores", 0) > 0
        until(lambda: held(restarted) == 0)
    finally:
        restarted.close()
