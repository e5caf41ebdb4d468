"""KV event subscribers as separate processes, for ``events.py``: SUB sockets that decode as a router does.

A subscriber process (``subscriber_main``, started by ``Subscribers``) imports
only pyzmq, msgspec and tiercache's wire structs (no torch: it starts in a
fraction of a second), connects to every endpoint it is given and decodes each
batch with msgspec's typed decoder into vLLM's structs. Marker events (a
``BlockRemoved`` of a ``MARK_*`` medium) steer it and are never counted: a ready
marker is answered once per publisher (ZeroMQ's slow joiner: a SUB socket
receives only once its subscription has reached the publisher), an end marker
with the round's counts and the time of its last counted batch, a quit marker
ends it. Not a sweep: ``scale.py`` does not run it.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from tiercache.telemetry.events.config import DEFAULT_TOPIC
from tiercache.telemetry.events.wire import KVEventBatch

MARK_READY, MARK_END, MARK_QUIT = "scale:ready", "scale:end", "scale:quit"
"""Marker events (a ``BlockRemoved`` of this medium) the subscriber processes act on; never counted."""
READY_POKE_S = 0.02
"""How long to wait for each process's answer between two ready markers while they connect."""
READY_TIMEOUT_S = 60.0
RESULT_TIMEOUT_S = 300.0
"""Longest wait for a round's counts (a subscriber that died or lost the end marker fails the sweep)."""
CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); from scaling._event_subscribers import subscriber_main; "
         "subscriber_main(sys.argv[2:])")
"""A subscriber process: ``benchmarks/`` on its path, then ``subscriber_main`` with the endpoints."""


def subscriber_main(endpoints: list[str]) -> None:
    """A subscriber process: SUB to ``endpoints``, typed decoding, one JSON line per ready marker and per round."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    for endpoint in endpoints:
        sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, DEFAULT_TOPIC)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events = blocks = 0
    last = 0.0
    ready: set[int] = set()
    while True:
        _, _, payload = sub.recv_multipart()
        for event in decoder.decode(payload).events:
            medium = getattr(event, "medium", None)
            if medium == MARK_READY:
                if event.block_hashes[0] not in ready:
                    ready.add(event.block_hashes[0])
                    print(json.dumps({"ready": event.block_hashes[0]}), flush=True)
            elif medium == MARK_END:
                print(json.dumps({"events": events, "blocks": blocks, "last_s": last}), flush=True)
                events = blocks = 0
            elif medium == MARK_QUIT:
                context.destroy(linger=0)
                return
            else:
                events += 1
                blocks += len(event.block_hashes)
                last = time.monotonic()


class Subscribers:
    """``count`` subscriber processes on ``endpoints``, and the lines they print (unbuffered, so ``select``
    sees every line not read yet)."""

    def __init__(self, count: int, endpoints: list[str]) -> None:
        argv = [sys.executable, "-c", CHILD, str(Path(__file__).resolve().parents[1]), *endpoints]
        self.processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, bufsize=0) for _ in range(count)]

    @staticmethod
    def _line(process: subprocess.Popen, timeout_s: float) -> dict[str, Any] | None:
        """The next line of ``process``, parsed; None if none came within ``timeout_s``."""
        stdout = process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        if not readable:
            return None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"events: subscriber process {process.pid} ended (exit status {process.wait()})")
        return json.loads(line)

    def wait_ready(self, publisher: int, poke: Callable[[], object]) -> None:
        """Call ``poke`` (which publishes a ready marker of ``publisher``) until every process has seen one."""
        waiting = list(self.processes)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"events: {len(waiting)} subscribers never saw publisher {publisher}")
            poke()
            waiting = [process for process in waiting
                       if (self._line(process, READY_POKE_S) or {}).get("ready") != publisher]

    def results(self) -> list[dict[str, Any]]:
        """One round's counts from every process (after an end marker)."""
        lines = [self._line(process, RESULT_TIMEOUT_S) for process in self.processes]
        counts = [line for line in lines if line is not None and "events" in line]
        if len(counts) != len(lines):
            raise RuntimeError(f"events: a subscriber did not report its round: {lines}")
        return counts

    def close(self) -> None:
        """Wait for the processes (after a quit marker), killing any still running."""
        for process in self.processes:
            try:
                process.wait(READY_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
