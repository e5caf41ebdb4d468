"""Real ``redis-server`` processes for tests and benchmarks: single servers and a 3-node cluster.

Every server listens on a free loopback port, keeps its files in its own
temporary directory, persists nothing (``--save '' --appendonly no``) and dies
with the test process (``PR_SET_PDEATHSIG``, an ``atexit`` hook, and the
fixtures' own teardown), so a failing or interrupted test leaves no stray
servers. A missing ``redis-server`` binary is an error, never a silent skip.
Also the test data helpers of the remote-tier tests (random blocks, buffers) and what a
server says was read (``reads``, ``stored_values``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiercache.blocks.codec import Codec
from tiercache.tiers.base import RemoteContext

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
CLUSTER_READY_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.02
START_ATTEMPTS = 5
DEFAULT_MAXMEMORY = "512mb"
DEFAULT_MAXMEMORY_POLICY = "allkeys-lru"
CLUSTER_NODE_TIMEOUT_MS = 1000
CLUSTER_SIZE = 3
_PR_SET_PDEATHSIG = 1
_LIVE: set[subprocess.Popen] = set()


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise RuntimeError(f"{binary} is not installed or not on PATH; the Redis tests need it")
    return path


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the test process dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


MAX_CLUSTER_PORT = 55535
"""A cluster node also listens on its port + 10000 (the bus), so its port must be at most this."""


def free_port() -> int:
    """A free loopback port low enough for a cluster node (port + 10000 must exist too)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as spare:
            spare.bind(("127.0.0.1", 0))
            port = spare.getsockname()[1]
        if port <= MAX_CLUSTER_PORT:
            return port


def _command(host: str, port: int, *args: str, timeout: float = 1.0) -> bytes:
    """Send one RESP command; return the reply's first line, or a bulk reply's body."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args
    )
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(payload)
        reply = b""
        while b"\r\n" not in reply:
            chunk = conn.recv(65536)
            if not chunk:
                return reply
            reply += chunk
        line, _, rest = reply.partition(b"\r\n")
        if not line.startswith(b"$") or line == b"$-1":
            return line
        length = int(line[1:])
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
        return rest[:length]


def _kill_all_live() -> None:
    for process in list(_LIVE):
        with contextlib.suppress(OSError):
            process.kill()
        with contextlib.suppress(Exception):
            process.wait(STOP_TIMEOUT_S)
    _LIVE.clear()


atexit.register(_kill_all_live)


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 with signal-level fault injection.

    ``kill()`` is ``kill -9``; ``stop()``/``cont()`` freeze and thaw it (SIGSTOP/
    SIGCONT, so clients time out); ``restart()`` brings it back on the same port,
    empty (nothing is persisted).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        maxmemory: str = DEFAULT_MAXMEMORY,
        maxmemory_policy: str = DEFAULT_MAXMEMORY_POLICY,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = _require("redis-server")
        self.host = "127.0.0.1"
        self.port = 0
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="tiercache-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", self.maxmemory_policy,
            *self.extra_args,
        ]

    def start(self) -> RedisServer:
        """Start on a free port (keeps the port once chosen); retries if it is taken."""
        fixed_port = self.port != 0
        last_error = ""
        for _ in range(START_ATTEMPTS):
            if not fixed_port:
                self.port = free_port()
            self.process = subprocess.Popen(
                self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                preexec_fn=_die_with_parent,
            )
            _LIVE.add(self.process)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    last_error = self._log_tail()
                    break
                with contextlib.suppress(OSError):
                    if _command(self.host, self.port, "PING"):  # PONG, or NOAUTH with ACLs
                        return self
                time.sleep(POLL_INTERVAL_S)
            self._reap()
            if fixed_port:
                time.sleep(POLL_INTERVAL_S * 10)
        raise RuntimeError(f"redis-server did not start on {self.address}: {last_error}")

    def _log_tail(self) -> str:
        stderr = self.process.stderr.read().decode(errors="replace") if self.process else ""
        log = self.workdir / "redis.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return (stderr + text)[-2000:]

    def _reap(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.send_signal(signal.SIGCONT)
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)
        if process.stderr:
            process.stderr.close()
        _LIVE.discard(process)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """``kill -9``: connections drop, the port refuses until ``restart()``."""
        self._reap()

    def stop(self) -> None:
        """SIGSTOP: the socket stays open but nothing answers (clients time out)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        """SIGCONT after ``stop()``."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Kill if running and start again, empty, on the same port."""
        self._reap()
        return self.start()

    def close(self) -> None:
        """Stop the process for good and remove its directory if we made it."""
        self._reap()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def cli(self, *args: str) -> str:
        """Run ``redis-cli`` against this server; returns its stdout (raises on failure)."""
        result = subprocess.run(
            [_require("redis-cli"), "-h", self.host, "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=START_TIMEOUT_S, check=True,
        )
        return result.stdout

    def subscribers(self, channel: str) -> int:
        """How many clients this server counts as subscribed to ``channel`` (``PUBSUB NUMSUB``)."""
        return int(self.cli("PUBSUB", "NUMSUB", channel).split()[1])

    def __enter__(self) -> RedisServer:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterNodes:
    """A 3-master, 0-replica Redis Cluster on loopback.

    ``cluster-require-full-coverage no`` keeps the surviving masters serving their
    slots while one node is down, which is what the node-down tests need.
    """

    def __init__(
        self, workdir: str | os.PathLike[str] | None = None, size: int = CLUSTER_SIZE
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="tiercache-cluster-"))
        self.nodes = [
            RedisServer(
                self.workdir / f"node{i}",
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                    "--cluster-require-full-coverage", "no",
                ],
            )
            for i in range(size)
        ]

    @property
    def host(self) -> str:
        return self.nodes[0].host

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self) -> RedisClusterNodes:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [_require("redis-cli"), "--cluster", "create",
                 *(node.address for node in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=CLUSTER_READY_TIMEOUT_S, check=True,
            )
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def wait_ready(self, nodes: Sequence[RedisServer] | None = None) -> None:
        """Wait until every (given) node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + CLUSTER_READY_TIMEOUT_S
        pending = list(nodes or self.nodes)
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ready on {[n.address for n in pending]}")
            with contextlib.suppress(OSError):
                info = _command(pending[0].host, pending[0].port, "CLUSTER", "INFO")
                if b"cluster_state:ok" in info:
                    pending.pop(0)
                    continue
            time.sleep(POLL_INTERVAL_S * 5)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisClusterNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


FINGERPRINT = b"tiercache-test-1"
OTHER_FINGERPRINT = b"another-model-02"


def remote_context(block_bytes: int, name: str = "remote") -> RemoteContext:
    """What the manager would pass a remote tier, with a test namespace."""
    return RemoteContext(name, Codec(FINGERPRINT), block_bytes)


def random_blocks(count: int, block_bytes: int, seed: int = 0) -> tuple[list[bytes], list[memoryview]]:
    """``count`` random 16-byte keys and random payloads (byte views)."""
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(count)]
    payloads = [memoryview(rng.integers(0, 256, block_bytes, dtype=np.uint8)).cast("B") for _ in keys]
    return keys, payloads


def slot_views(count: int, block_bytes: int, seed: int | None = None) -> list[memoryview]:
    """``count`` block slots in one allocation, as a CPU tier holds them (torch's allocator aligns it to 64
    bytes, and the kernel copies between page cache or sockets and such slots at full speed, where a
    16-byte-aligned numpy buffer costs a large copy up to half its rate): random bytes from ``seed``, else zeros."""
    pool = torch.zeros((count, block_bytes), dtype=torch.uint8)
    if seed is not None:
        pool.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (count, block_bytes), np.uint8)))
    return [memoryview(pool[index].numpy()).cast("B") for index in range(count)]


def empty_dests(count: int, block_bytes: int) -> list[memoryview]:
    """Writable destination buffers, like CPU-tier slots."""
    return slot_views(count, block_bytes)


EXPIRED_CHANNEL = "__keyevent@0__:expired"
"""Where a server with keyspace notifications publishes the expiries of database 0 (Redis's naming)."""
NOTHING_READ = {"get": 0, "unlink": 0, "del": 0, "keyspace_hits": 0}
"""``reads`` of a server that no command read a value of, or deleted one from."""


def stored_values(client: Any) -> dict[bytes, bytes]:
    """Every value in the server (``client``: a ``redis.Redis``), by name."""
    return {name: client.get(name) for name in client.keys("*")}


def reads(client: Any) -> dict[str, int]:
    """Since the last ``CONFIG RESETSTAT``: calls of the commands that read or delete a value, and how many
    lookups of any command found a key (``keyspace_hits``: a GET or EXISTS of an absent key is a miss)."""
    stats = client.info("commandstats")
    calls = {command: stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in ("get", "unlink", "del")}
    return {**calls, "keyspace_hits": client.info("stats")["keyspace_hits"]}
