"""What a Redis server on this machine allows, for ``remote.py``: redis-benchmark and a bare socket loop.

``sweep`` runs ``redis-benchmark`` over every ``-c``/``-P`` setting (``-r``:
overwriting a small key space, as the tier's timed passes overwrite theirs) and
keeps the best rate per command with the setting that won; a setting it aborts
on (on a cluster, ``-P 16``: "All clients disconnected") is recorded and left out.
``rerun`` times the winning setting again: the sweep's best is the largest of six
noisy draws (on this machine one setting's rate moves up to 2x from run to run),
so a client measured fewer times than that would be compared with a lucky draw.
``socket_loop_rate`` is the leanest client Python can be: one socket, one
``sendmsg`` per SET, as many in flight as the tier keeps, no value check; over
distinct payloads (what the tier sends) or one payload over and over (what
redis-benchmark sends: its value stays in the CPU cache). ``socket_get_rate``
is its reading twin: GETs sent in groups of half the window, each reply received
with one ``recvmsg_into`` straight into a slot, no value check; either one stream
that never drains (as redis-benchmark asks) or batches that drain before the
next is asked (as a caller making one call at a time must).
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Sequence

CLIENTS = (1, 4, 8)
PIPELINES = (1, 16)
KEYSPACE = 64
"""redis-benchmark -r: spread keys (over a cluster's nodes) yet keep them all SET before GETs."""
REQUEST_BYTES = 512 * 2**20
"""Bytes one redis-benchmark run moves per command (its -n is this over the value size, at least 1000)."""
MIN_REQUESTS = 1000
OK_REPLY = b"+OK\r\n"
STORE_GROUP = 16
"""SETs ``socket_get_rate`` sends before reading their replies, while it stores its values (untimed)."""
GB = 1e9


def redis_benchmark(
    host: str, port: int, value_bytes: int, cluster: bool, clients: int, pipeline: int, ops: str = "set,get"
) -> tuple[dict[str, float], bool]:
    """GB/s per command of one redis-benchmark run, and whether it ran to the end."""
    requests = max(MIN_REQUESTS, REQUEST_BYTES // value_bytes)
    argv = ["redis-benchmark", "-h", host, "-p", str(port), "-t", ops, "-d", str(value_bytes),
            "-n", str(requests), "-r", str(KEYSPACE), "-c", str(clients), "-P", str(pipeline), "-q"]
    if cluster:
        argv.append("--cluster")
    result = subprocess.run(argv, capture_output=True, text=True)
    rates = {op: float(rps) * value_bytes / GB
             for op, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", result.stdout)}
    return rates, result.returncode == 0


def sweep(host: str, port: int, value_bytes: int, cluster: bool) -> dict[str, dict]:
    """Best SET and GET GB/s over every ``-c``/``-P`` setting, each with the setting that won."""
    best: dict[str, dict] = {"failed": {"settings": []}}
    for clients in CLIENTS:
        for pipeline in PIPELINES:
            rates, finished = redis_benchmark(host, port, value_bytes, cluster, clients, pipeline)
            if not finished:
                best["failed"]["settings"].append(f"-c {clients} -P {pipeline}")
            for op, rate in rates.items():
                if rate > best.get(op, {}).get("gbps", 0.0):
                    best[op] = {"gbps": rate, "setting": f"-c {clients} -P {pipeline}",
                                "clients": clients, "pipeline": pipeline}
    return best


def rerun(host: str, port: int, value_bytes: int, cluster: bool, best: dict, op: str) -> float:
    """GB/s of one fresh run of ``op`` (``SET`` or ``GET``) at the setting that won the sweep ``best``."""
    won = best[op]
    rates, _ = redis_benchmark(host, port, value_bytes, cluster, won["clients"], won["pipeline"], op.lower())
    return rates.get(op, 0.0)


def socket_loop_rate(
    host: str, port: int, payloads: Sequence[memoryview], count: int, in_flight: int, distinct: bool
) -> float:
    """GB/s of ``count`` SETs from a bare socket loop (``payloads`` in turn if ``distinct``, else the first),
    after one untimed pass so that every SET overwrites, as the tier's timed ones do."""
    size = len(payloads[0])
    commands = [b"*3\r\n$3\r\nSET\r\n$9\r\nloop:%04d\r\n$%d\r\n" % (i % 10000, size) for i in range(count)]
    replies = bytearray(len(OK_REPLY) * in_flight)
    rate = 0.0
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for timed in (False, True):
            sent = answered = 0
            started = time.perf_counter()
            for i, head in enumerate(commands):
                sock.sendmsg([head, payloads[i % len(payloads)] if distinct else payloads[0], b"\r\n"])
                sent += 1
                while sent - answered // len(OK_REPLY) >= in_flight:
                    answered += sock.recv_into(replies)
            while answered < sent * len(OK_REPLY):
                answered += sock.recv_into(replies)
            if timed:
                rate = count * size / (time.perf_counter() - started) / GB
        sock.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
        sock.recv(64)
    return rate


def socket_get_rate(
    host: str,
    port: int,
    payloads: Sequence[memoryview],
    dests: Sequence[memoryview],
    count: int,
    in_flight: int,
    batch: int | None,
) -> float:
    """GB/s of ``count`` GETs of distinct values (``payloads`` in turn, stored first) from a bare socket loop
    into ``dests`` in turn, at most ``in_flight`` outstanding; in batches of ``batch`` that drain before the
    next is asked, or one stream if None."""
    size = len(payloads[0])
    names = [b"loop:%05d" % i for i in range(count)]
    gets = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name) for name in names]
    head, tail = bytearray(len(b"$%d\r\n" % size)), bytearray(2)
    group = max(1, in_flight // 2)
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        replies = bytearray(len(OK_REPLY) * STORE_GROUP)
        for first in range(0, count, STORE_GROUP):
            stored = names[first : first + STORE_GROUP]
            for offset, name in enumerate(stored):
                command = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size)
                sock.sendmsg([command, payloads[(first + offset) % len(payloads)], b"\r\n"])
            sock.recv_into(replies, len(OK_REPLY) * len(stored), socket.MSG_WAITALL)
        started = time.perf_counter()
        step = batch or count
        for first in range(0, count, step):
            last = min(count, first + step)
            sent = first
            for index in range(first, last):
                if sent < last and sent - index <= in_flight - group:
                    ahead = min(last, sent + group)
                    sock.sendall(b"".join(gets[sent:ahead]))
                    sent = ahead
                received = sock.recvmsg_into([head, dests[index % len(dests)], tail], 0, socket.MSG_WAITALL)[0]
                expected = len(head) + size + len(tail)
                if received != expected:
                    raise ConnectionError(f"GET loop: a reply of {received} bytes, expected {expected}")
        rate = count * size / (time.perf_counter() - started) / GB
        sock.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
        sock.recv(64)
    return rate
