"""The Redis tier as keys pile up: µs per block of presence checks and reads, and memory per block, at 10^4-10^6 keys.

One ``redis-server`` (``tiercache.testing.redis_servers``, maxmemory far above
what the keys take, so nothing is evicted) is filled in stages to each size
through the tier's own lane (``Lane.put``, as write-backs reach it: pipelined
SETs of valid values, the checksum carried), small blocks of ``BLOCK_BYTES``.
At each size, ``ROUNDS`` rounds, each asking in turn (so the machine's drift
hits every path alike), over keys drawn at random from those held:

* ``contains`` of ``PRESENCE_BATCH`` held keys and of as many never stored
  (EXISTS), and ``get_into`` of ``READ_BATCH`` held keys (GET, every value
  validated), each through the tier's lane (``Lane.contains`` / ``Lane.read``:
  what ``LowerTiers`` and ``RemoteStore`` call, limiter, deadline and breaker
  included) and on the tier object directly;
* the reference: the same commands for the same Redis keys, pipelined as one
  ``sendall`` on one bare socket, replies received whole (no value check).

Figures are medians over the rounds, in µs per block; ``growth`` is a path's
figure at the largest size over the smallest's. Memory per block is the
growth of ``INFO memory``'s ``used_memory`` over the keys stored; what Redis
keeps beyond the value is that less the value's bytes (tiercache's header and the
payload; the key name counts as Redis's), and ``header_share`` is the header's
part of the memory per block.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from tiercache.blocks.value_format import HEADER_SIZE, payload_checksum
from tiercache.common.units import US_PER_SECOND
from tiercache.config.topology import QueueConfig
from tiercache.movement.lanes import Lane
from tiercache.telemetry.counters import Metrics
from tiercache.testing.redis_servers import RedisServer, remote_context, slot_views
from tiercache.tiers.base import Presence
from tiercache.tiers.redis import RedisOptions, RedisTier
from tiercache.tiers.redis.commands import KEYS_IN_FLIGHT

NAME = "redis_keys"
SIZES = (10_000, 100_000, 1_000_000)
"""Keys held at each stage (filled cumulatively on one server)."""
QUICK_SIZES = (1_000, 4_000)
BLOCK_BYTES = 128
"""A small block's payload: the server's per-key work and memory, not the bytes moved, dominate."""
PRESENCE_BATCH = KEYS_IN_FLIGHT
"""Keys per ``contains``: a prompt's presence check of this many blocks is one round trip for the tier."""
READ_BATCH = QueueConfig().batch_blocks
"""Keys per ``get_into``: a load's batch."""
FILL_BATCH = 4096
"""Keys per ``put`` while filling (untimed for the figures, timed for the fill rate)."""
ROUNDS = 200
QUICK_ROUNDS = 5
MAXMEMORY = "4gb"
"""Far above 10^6 small values (about 0.3 GB): no key is evicted."""
KEY_BYTES = 16
SEED = 51
REPLY_TIMEOUT_S = 30.0
"""A reference reply that takes longer means a wrong expected length: fail, never hang."""
EXISTS_REPLY_BYTES = len(b":1\r\n")
PATHS = ("lane", "tier", "raw")
"""How each op is asked: through the lane, on the tier object, on a bare socket (the reference)."""
OPS = ("contains_held", "contains_absent", "get")


def exists_request(name: bytes) -> bytes:
    """One RESP EXISTS command."""
    return b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(name), name)


def get_request(name: bytes) -> bytes:
    """One RESP GET command."""
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)


class RawSocket:
    """The reference client: one socket, a batch of commands in one ``sendall``, the replies received whole."""

    def __init__(self, host: str, port: int, value_bytes: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=REPLY_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.get_reply_bytes = len(b"$%d\r\n" % value_bytes) + value_bytes + len(b"\r\n")
        self.buffer = bytearray(max(EXISTS_REPLY_BYTES * PRESENCE_BATCH, self.get_reply_bytes * READ_BATCH))

    def _receive(self, nbytes: int) -> memoryview:
        view = memoryview(self.buffer)[:nbytes]
        received = 0
        while received < nbytes:
            got = self.sock.recv_into(view[received:], nbytes - received)
            if not got:
                raise ConnectionError("reference socket: the server closed the connection")
            received += got
        return view

    def exists(self, names: Sequence[bytes]) -> int:
        """EXISTS of every name; how many are held."""
        self.sock.sendall(b"".join(exists_request(name) for name in names))
        return bytes(self._receive(EXISTS_REPLY_BYTES * len(names))).count(b":1")

    def get(self, names: Sequence[bytes]) -> int:
        """GET of every name (all held, all of the tier's value size); the bytes received."""
        self.sock.sendall(b"".join(get_request(name) for name in names))
        return len(self._receive(self.get_reply_bytes * len(names)))

    def close(self) -> None:
        self.sock.close()


def used_memory(server: RedisServer) -> int:
    """``used_memory`` of ``INFO memory``, in bytes."""
    for line in server.cli("INFO", "memory").splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    raise RuntimeError("INFO memory without used_memory")


def server_field(server: RedisServer, section: str, field: str) -> int:
    """An integer field of an ``INFO`` section."""
    for line in server.cli("INFO", section).splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split(":")[1])
    raise RuntimeError(f"INFO {section} without {field}")


def random_keys(count: int, rng: np.random.Generator) -> list[bytes]:
    """``count`` random block keys."""
    raw = rng.bytes(KEY_BYTES * count)
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


async def fill(lane: Lane, keys: Sequence[bytes], payloads: Sequence[memoryview], sums: Sequence[int]) -> float:
    """Store ``keys`` through the lane, ``FILL_BATCH`` at a time; µs per block."""
    started = time.perf_counter()
    for first in range(0, len(keys), FILL_BATCH):
        chunk = keys[first : first + FILL_BATCH]
        stored = await lane.put(chunk, payloads[: len(chunk)], sums[: len(chunk)])
        if not all(stored):
            raise RuntimeError(f"fill: {stored.count(False)} of {len(chunk)} puts failed: {lane.tier.stats()}")
    return (time.perf_counter() - started) * US_PER_SECOND / max(1, len(keys))


async def timed_us(call: Callable[[], Awaitable[object] | object], blocks: int) -> float:
    """µs per block of one call (awaited when it is a coroutine)."""
    started = time.perf_counter()
    result = call()
    if asyncio.iscoroutine(result):
        await result
    return (time.perf_counter() - started) * US_PER_SECOND / blocks


class Probes:
    """One round's calls per op and path, over keys drawn from those held (and keys never stored)."""

    def __init__(self, lane: Lane, tier: RedisTier, raw: RawSocket, dests: Sequence[memoryview]) -> None:
        self.lane, self.tier, self.raw, self.dests = lane, tier, raw, dests

    def calls(self, held: list[bytes], absent: list[bytes], read: list[bytes]) -> dict[str, dict[str, Callable]]:
        """Per op, per path: the call, checked against what the server holds."""
        tier = self.tier
        names = {"held": tier.redis_keys(held), "absent": tier.redis_keys(absent), "read": tier.redis_keys(read)}

        async def lane_contains(keys: list[bytes], expected: Presence) -> None:
            require(all(p is expected for p in await self.lane.contains(keys)), "lane contains")

        async def tier_contains(keys: list[bytes], expected: Presence) -> None:
            require(all(p is expected for p in await tier.contains(keys)), "tier contains")

        async def lane_get() -> None:
            answer = await self.lane.read(read, self.dests)
            require(answer.oks is not None and all(answer.oks), "lane read")

        async def tier_get() -> None:
            require(all(await tier.get_into(read, self.dests)), "tier get_into")

        def raw_exists(which: str, expected: int) -> None:
            require(self.raw.exists(names[which]) == expected, "raw EXISTS")

        return {
            "contains_held": {"lane": lambda: lane_contains(held, Presence.HELD),
                              "tier": lambda: tier_contains(held, Presence.HELD),
                              "raw": lambda: raw_exists("held", len(held))},
            "contains_absent": {"lane": lambda: lane_contains(absent, Presence.ABSENT),
                                "tier": lambda: tier_contains(absent, Presence.ABSENT),
                                "raw": lambda: raw_exists("absent", 0)},
            "get": {"lane": lane_get, "tier": tier_get, "raw": lambda: self.raw.get(names["read"])},
        }


def require(ok: bool, what: str) -> None:
    """A wrong answer fails the benchmark (figures of calls that missed would mean nothing)."""
    if not ok:
        raise RuntimeError(f"{what}: an answer that does not match what the server holds")


async def measure(probes: Probes, held: list[bytes], rng: np.random.Generator, rounds: int) -> dict[str, dict]:
    """Median µs per block per op and path over ``rounds`` rounds, each on fresh random keys."""
    samples: dict[str, dict[str, list[float]]] = {op: {path: [] for path in PATHS} for op in OPS}
    sizes = {"contains_held": PRESENCE_BATCH, "contains_absent": PRESENCE_BATCH, "get": READ_BATCH}
    for index in range(rounds):
        chosen = [held[i] for i in rng.integers(0, len(held), PRESENCE_BATCH + READ_BATCH)]  # uniform over all
        calls = probes.calls(chosen[:PRESENCE_BATCH], random_keys(PRESENCE_BATCH, rng), chosen[PRESENCE_BATCH:])
        order = PATHS if index % 2 == 0 else PATHS[::-1]  # mirrored rounds: neither path always goes first
        for op in OPS:
            for path in order:
                samples[op][path].append(await timed_us(calls[op][path], sizes[op]))
    return {op: {path: statistics.median(values) for path, values in paths.items()} for op, paths in samples.items()}


async def sweep(sizes: Sequence[int], rounds: int) -> dict[str, Any]:
    """Every size's row: fill to it, measure, read the server's memory."""
    rng = np.random.default_rng(SEED)
    keys = random_keys(sizes[-1], rng)
    payloads = slot_views(FILL_BATCH, BLOCK_BYTES, SEED)
    sums = [payload_checksum(view) for view in payloads]
    dests = slot_views(READ_BATCH, BLOCK_BYTES)
    queues = QueueConfig()
    rows = []
    with RedisServer(maxmemory=MAXMEMORY) as server:
        tier = RedisTier(remote_context(BLOCK_BYTES, "redis"), RedisOptions(url=server.url))
        lane = Lane(0, tier, queues.transfer_concurrency, Metrics(), queues.remote_lookup_timeout_ms / 1000)
        await tier.start()
        raw = RawSocket(server.host, server.port, HEADER_SIZE + BLOCK_BYTES)
        try:
            empty = used_memory(server)
            held = 0
            for size in sizes:
                fill_us = await fill(lane, keys[held:size], payloads, sums)
                held = size
                require(int(server.cli("DBSIZE")) == size, "DBSIZE after the fill")
                memory = used_memory(server)
                figures = await measure(Probes(lane, tier, raw, dests), keys[:held], rng, rounds)
                rows.append(size_row(size, fill_us, figures, (memory - empty) / size, server,
                                     len(tier.redis_key(keys[0]))))
        finally:
            raw.close()
            await tier.close()
    return {"rows": rows, "growth": growth(rows)}


def size_row(size: int, fill_us: float, figures: dict, memory_per_block: float, server: RedisServer,
             key_name_bytes: int) -> dict[str, Any]:
    """One size's figures, with the reference ratios and the memory per block."""
    value_bytes = HEADER_SIZE + BLOCK_BYTES
    row: dict[str, Any] = {"keys_held": size, "fill_lane_put_us_per_block": fill_us}
    for op, paths in figures.items():
        for path, us in paths.items():
            row[f"{op}_{path}_us"] = us
        row[f"{op}_lane_vs_raw"] = paths["lane"] / paths["raw"]
    row.update({
        "memory_per_block_bytes": memory_per_block,
        "value_bytes": value_bytes,
        "header_bytes": HEADER_SIZE,
        "key_name_bytes": key_name_bytes,
        "beyond_value_bytes": memory_per_block - value_bytes,
        "header_share": HEADER_SIZE / memory_per_block,
        "evicted_keys": server_field(server, "stats", "evicted_keys"),
    })
    return row


def growth(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per op and path, µs per block at the largest size over the smallest (1.0: flat)."""
    first, last = rows[0], rows[-1]
    return {f"{op}_{path}": last[f"{op}_{path}_us"] / first[f"{op}_{path}_us"] for op in OPS for path in PATHS}


def run(quick: bool) -> dict[str, Any]:
    """The section: a row per size, growth ratios, the load average at start and end."""
    load_start = os.getloadavg()
    started = time.perf_counter()
    section = asyncio.run(sweep(QUICK_SIZES if quick else SIZES, QUICK_ROUNDS if quick else ROUNDS))
    return {
        **section,
        "block_bytes": BLOCK_BYTES,
        "presence_batch": PRESENCE_BATCH,
        "read_batch": READ_BATCH,
        "rounds": QUICK_ROUNDS if quick else ROUNDS,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "runtime_s": time.perf_counter() - started,
    }


def table(section: dict[str, Any]) -> list[str]:
    """Markdown: per size, µs per block through the lane and on the bare socket, and memory per block."""
    lines = [
        "| keys held | contains held: lane / tier / raw µs | contains absent: lane / tier / raw µs "
        "| get: lane / tier / raw µs | lane/raw (held, absent, get) | fill µs | B per block | beyond value B "
        "| header share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in section["rows"]:
        cells = [f"{row['keys_held']:,}"]
        for op in OPS:
            cells.append(" / ".join(f"{row[f'{op}_{path}_us']:.2f}" for path in PATHS))
        cells.append(", ".join(f"{row[f'{op}_lane_vs_raw']:.2f}" for op in OPS))
        cells += [f"{row['fill_lane_put_us_per_block']:.2f}", f"{row['memory_per_block_bytes']:.0f}",
                  f"{row['beyond_value_bytes']:.0f}", f"{row['header_share']:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    ratios = section["growth"]
    cells = [f"growth x{section['rows'][-1]['keys_held'] // section['rows'][0]['keys_held']}"]
    cells += [" / ".join(f"{ratios[f'{op}_{path}']:.2f}x" for path in PATHS) for op in OPS]
    lines.append("| " + " | ".join(cells + [""] * 5) + " |")
    return lines
