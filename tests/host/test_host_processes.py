"""The host server and engines as separate processes: an engine killed outright, a server frozen or stopped.

``tiercache serve`` runs as a user starts it; the killed engine is a real
process whose death the server learns from its socket, never from a message.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.host_helpers import (
    WAIT_S,
    client,
    drop_cpu_tier,
    held_slots,
    host_config,
    write,
    write_topology,
)
from support.lower_tiers_helpers import block_bytes, chain, simulated, store_name, until

from tiercache.host.client import HostTiers
from tiercache.host.server import HostServer
from tiercache.telemetry.stats_server import fetch_stats

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tiercache.config import load_config
    from tiercache.host.client import HostTiers
    tiers = HostTiers(load_config(sys.argv[1], engine_pool=True), Path(sys.argv[2]))
    tiers.start()
    keys = tiers.hasher.keys(list(range(int(sys.argv[3]) * tiers.block_size)))
    while (hit := tiers.lookup(keys)) is None:
        tiers.wait_for_answers(1.0)
    fetch = tiers.fetch(hit)
    written = tiers.begin_writes(tiers.hasher.keys(list(range(10**6, 10**6 + 2 * tiers.block_size))))
    print(hit.num_blocks, fetch.ready(), sum(slot is not None for slot in written), flush=True)
    time.sleep(600)
""")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=WAIT_S)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (its state in /proc is T)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def spawn(processes: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    processes.append(process)
    return process


def test_an_engine_killed_mid_fetch_leaves_nothing_pinned(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers],
        processes: list[subprocess.Popen[str]]) -> None:
    store = store_name()
    topology = {"cpu_blocks": 8, "remotes": [simulated(store, latency_ms=100)]}
    server = HostServer(host_config(**topology), socket_dir / "host.sock", shared_dir=socket_dir,
                        lease_grace_s=3600.0)  # only an engine's death can free its leases in time
    servers.append(server.start())
    engine = client(server.socket_path, opened, config=host_config(**topology))
    keys = engine.hasher.keys(list(range(4 * engine.block_size)))
    write(engine, keys)
    drop_cpu_tier(server, 4)
    holder = spawn(processes, "-c", HOLDER, str(write_topology(socket_dir / "t.yaml", **topology)),
                   str(server.socket_path), "4")
    assert holder.stdout is not None
    blocks, ready, writing = holder.stdout.readline().split()
    assert (blocks, ready, writing) == ("4", "False", "2"), "killed while its fetch from the remote is in flight"
    assert held_slots(server) == 6
    holder.kill()
    holder.wait(timeout=WAIT_S)
    until(lambda: held_slots(server) == 0)
    fresh = client(server.socket_path, opened, config=host_config(**topology))
    fetch = fresh.fetch(until(lambda: fresh.lookup(keys)))
    assert fetch.wait(WAIT_S)
    assert [bytes(fresh.buffer_view(slot)) for slot in fetch.slots()] == [block_bytes(engine, k) for k in keys]
    fetch.release()


def test_a_live_engine_s_leases_outlast_its_connection_for_the_grace(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = HostServer(host_config(), socket_dir / "host.sock", shared_dir=socket_dir, lease_grace_s=3600.0)
    servers.append(server.start())
    first, second = client(server.socket_path, opened), client(server.socket_path, opened)
    keys = chain(first, 2, salt=1)
    write(first, keys)
    fetch = second.fetch(second.lookup(keys))  # type: ignore[arg-type]
    assert fetch.ready() and len(fetch.slots()) == 2
    second.close()  # a client that timed out detaches so; its workers may still be copying out of the slots
    until(lambda: server.stats()["host"]["engines"] == 1)
    assert held_slots(server) == 2, "its process lives: the slots stay pinned for the grace"


def test_tiercache_serve_frozen_is_a_miss_then_serves_again_with_its_stats_and_stops_cleanly(
        socket_dir: Path, opened: list[HostTiers], processes: list[subprocess.Popen[str]]) -> None:
    topology = socket_dir / "host.yaml"  # tiers only: the engine gives its model and layout when it attaches
    topology.write_text(yaml.safe_dump({"tiers": [{"type": "cpu", "capacity_blocks": 8}]}))
    socket_path = socket_dir / "host.sock"
    server = spawn(processes, "-m", "tiercache", "serve", "--config", str(topology), "--socket", str(socket_path),
                   "--shared-dir", str(socket_dir), "--stats-port", "0")
    assert server.stdout is not None
    stats_url = re.search(r"http://127\.0\.0\.1:\d+", server.stdout.readline())
    assert stats_url is not None and "tiercache serve" in server.stdout.readline()
    assert fetch_stats(stats_url[0])["host"]["engines"] == 0
    engine = client(socket_path, opened, config=host_config(), reply_timeout_s=0.3, retry_s=0.05)
    assert engine.attached
    keys = chain(engine, 3, salt=2)
    write(engine, keys)
    assert until(lambda: engine.lookup(keys).num_blocks == 3)
    os.kill(server.pid, signal.SIGSTOP)
    until(lambda: stopped(server.pid))  # a signal is delivered when its process next runs
    assert engine.lookup(keys).num_blocks == 0, "a frozen server is a miss within the reply bound"
    assert not engine.attached
    assert engine.begin_writes(keys) == [None] * 3
    os.kill(server.pid, signal.SIGCONT)
    assert engine.wait_attached(WAIT_S)
    hit = until(lambda: engine.lookup(keys))
    assert hit.num_blocks == 3, "the server kept its tier while frozen"
    engine.release(hit)
    served = fetch_stats(stats_url[0])
    assert served["host"]["engines"] == 1 and served["tiers"]["cpu"]["cached_blocks"] == 3
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=WAIT_S) == 0
    assert not socket_path.exists() and not list(socket_dir.glob("tiercache-host-*"))
