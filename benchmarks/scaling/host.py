"""The host cache server's costs against the same calls in the engine's own process, measured in the same run.

``tiercache serve`` runs as a user starts it (its own process); the engine's
side is a ``HostTiers`` here, the reference a ``LowerTiers`` in this process
over the same topology. Three sweeps:

1. A one-block hit (lookup, fetch, the engine's copy out of the slot, release)
   of 16 KiB, 128 KiB and 2 MiB, against the same hit through ``LowerTiers`` and
   against a bare memcpy and dict lookup (the ceiling of ``small_hit``). The
   socket adds two round trips (lookup and fetch; the release is sent without
   waiting), a fixed cost the copy does not share.
2. A lookup of 1 to 16,384 keys in one call: µs a key, through the server and in
   process (the keys cross the socket as 16-byte strings; nothing else grows),
   and a call's time against the floor of a round trip on this machine: 20 bytes
   echoed over a Unix socket pair by a forked process that does nothing else.
3. Engines attached, 1 to 32, all but one idle: the working engine's lookup
   (a thread per engine on the server; none works for an engine that sends nothing).
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from scaling.small_hit import SMALL_LAYOUTS, memcpy, prompt, written
from tiercache.config import config_from_dict
from tiercache.host.client import HostTiers
from tiercache.manager.lower_tiers import LowerTiers

NAME = "host"
US = 1e6
P99 = 0.99
DESTINATIONS = 64
"""Destination blocks the copies cycle over (an engine's pool, as in ``small_hit``)."""
ECHO_BYTES = 20
"""A small call's frame."""
SERVER_START_S = 60.0
"""Bound on ``tiercache serve``'s start (a hang detector)."""


def run(quick: bool) -> dict[str, Any]:
    rounds, prompts = (40, 80) if quick else (2000, 160)
    key_counts = (1, 64, 1024) if quick else (1, 64, 1024, 16384)
    engine_counts = (1, 4) if quick else (1, 8, 32)
    hits = [hit_row(label, layout, rounds, prompts) for label, layout in SMALL_LAYOUTS.items()]
    layout = SMALL_LAYOUTS["16 KiB"]
    with Served(layout, max(key_counts)) as served:
        lookups = [lookup_row(served, count, max(5, rounds // 10)) for count in key_counts]
    with Served(layout, max(key_counts)) as served:
        engines = [engines_row(served, count, rounds) for count in engine_counts]
    base = engines[0]["lookup_p50_us"]
    for row in engines:
        row["growth"] = row["lookup_p50_us"] / base
    echo = socket_echo_us(rounds)
    for row in lookups:
        row["host_call_vs_echo"] = row["host_us"] / echo
    return {"hits": hits, "rows": lookups, "engines": engines, "rounds": rounds, "socket_echo_p50_us": echo}


def table(section: dict[str, Any]) -> list[str]:
    lines = ["| block | host server hit p50 / p99 (µs) | LowerTiers p50 / p99 (µs) | memcpy + dict p50 (µs) "
             "| host / ceiling | LowerTiers / ceiling |", "|---|---|---|---|---|---|"]
    for row in section["hits"]:
        host, lower = row["host"], row["lower_tiers"]
        lines.append(f"| {row['block']} | {host['p50_us']:.0f} / {host['p99_us']:.0f} | {lower['p50_us']:.0f} / "
                     f"{lower['p99_us']:.0f} | {row['ceiling_p50_us']:.1f} | {row['host_ratio']:.2f}x "
                     f"| {row['lower_tiers_ratio']:.2f}x |")
    lines += ["", f"| keys a lookup | host µs a call | / a bare socket echo ({section['socket_echo_p50_us']:.0f} µs) "
              "| host µs a key | LowerTiers µs a key |", "|---|---|---|---|---|"]
    for row in section["rows"]:
        lines.append(f"| {row['keys']} | {row['host_us']:.0f} | {row['host_call_vs_echo']:.2f}x "
                     f"| {row['host_us_per_key']:.2f} | {row['lower_us_per_key']:.2f} |")
    lines += ["", "| engines attached | lookup p50 (µs) | growth |", "|---|---|---|"]
    for row in section["engines"]:
        lines.append(f"| {row['engines']} | {row['lookup_p50_us']:.0f} | {row['growth']:.2f}x |")
    return lines


class Served:
    """``tiercache serve`` over one CPU tier of ``slots`` blocks of ``layout``, in its own process."""

    def __init__(self, layout: dict[str, Any], slots: int) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="tch-bench-"))
        self.topology = {"model": {"id": "host-bench"}, "layout": layout,
                         "tiers": [{"type": "cpu", "capacity_blocks": slots, "policy": "s3fifo"}]}
        self.config = config_from_dict(self.topology, environ={}, engine_pool=True)
        self.socket = self.directory / "host.sock"
        self.clients: list[HostTiers] = []

    def __enter__(self) -> Served:
        path = self.directory / "host.yaml"
        path.write_text(yaml.safe_dump(self.topology))
        self.process = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", "--config", str(path), "--socket",
                                         str(self.socket), "--shared-dir", str(self.directory)],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        if "tiercache serve" not in self.process.stdout.readline():
            raise RuntimeError("host: tiercache serve did not start")
        return self

    def client(self) -> HostTiers:
        tiers = HostTiers(self.config, self.socket)
        tiers.start()
        if not tiers.wait_attached(SERVER_START_S):
            raise RuntimeError("host: the client did not attach")
        self.clients.append(tiers)
        return tiers

    def lower(self) -> LowerTiers:
        lower = LowerTiers(self.config)
        lower.start()
        return lower

    def __exit__(self, *exc_info: object) -> None:
        for tiers in self.clients:
            tiers.close()
        self.process.terminate()
        self.process.wait(timeout=SERVER_START_S)


def stored(tiers: HostTiers | LowerTiers, prompts: int, view: Callable[[int], np.ndarray]) -> list[list[bytes]]:
    """Store ``prompts`` one-block prompts as an engine does; their keys."""
    chains = [tiers.hasher.keys(prompt(index)) for index in range(prompts)]
    for index, keys in enumerate(chains):
        slots = tiers.begin_writes(keys)
        if slots[0] is None:
            raise RuntimeError("host: no CPU slot for a write")
        view(slots[0])[:] = index % 251
        tiers.end_writes(keys, [slots[0]], [True])
    tiers.stats()  # the writes have landed
    return chains


def hit_path(tiers: HostTiers | LowerTiers, chains: list[list[bytes]], slots: np.ndarray, block_bytes: int
             ) -> Callable[[int], None]:
    destinations = written((DESTINATIONS, block_bytes), 0)

    def hit(index: int) -> None:
        found = tiers.lookup(chains[index % len(chains)])
        if found is None or found.num_blocks != 1:
            raise RuntimeError("host: expected a one-block CPU hit")
        fetch = tiers.fetch(found)  # type: ignore[arg-type]
        np.copyto(destinations[index % DESTINATIONS], slots[fetch.slots()[0]])
        fetch.release()

    return hit


def hit_row(label: str, layout: dict[str, Any], rounds: int, prompts: int) -> dict[str, Any]:
    with Served(layout, prompts) as served:
        host, lower = served.client(), served.lower()
        try:
            assert host.region is not None
            host_slots = host.region.slots.numpy()
            lower_slots = lower.parts.cpu.buffer.numpy()  # type: ignore[union-attr]
            block_bytes = host.bytes_per_block
            paths = {
                "host": hit_path(host, stored(host, prompts, lambda s: host_slots[s]), host_slots, block_bytes),
                "lower_tiers": hit_path(lower, stored(lower, prompts, lambda s: lower_slots[s]), lower_slots,
                                        block_bytes),
                "memcpy": memcpy(prompts, block_bytes),
            }
            samples = timed_rounds(paths, rounds)
        finally:
            lower.close()
    ceiling = samples["memcpy"]["p50_us"]
    return {"block": label, "block_bytes": block_bytes, **samples, "ceiling_p50_us": ceiling,
            "host_ratio": samples["host"]["p50_us"] / ceiling,
            "lower_tiers_ratio": samples["lower_tiers"]["p50_us"] / ceiling}


def lookup_row(served: Served, keys: int, rounds: int) -> dict[str, Any]:
    host, lower = served.client(), served.lower()
    try:
        chain = host.hasher.keys(list(range(10**7, 10**7 + keys * host.block_size)))

        def looked_up(tiers: HostTiers | LowerTiers) -> Callable[[int], None]:
            def lookup(_: int) -> None:
                found = tiers.lookup(chain)
                if found is not None:
                    tiers.release(found)  # type: ignore[arg-type]
            return lookup

        samples = timed_rounds({"host": looked_up(host), "lower": looked_up(lower)}, rounds)
    finally:
        lower.close()
    return {"keys": keys, "host_us": samples["host"]["p50_us"], "host_us_per_key": samples["host"]["p50_us"] / keys,
            "lower_us_per_key": samples["lower"]["p50_us"] / keys}


def engines_row(served: Served, engines: int, rounds: int) -> dict[str, Any]:
    while len(served.clients) < engines:  # the earlier rows' engines stay attached, idle
        served.client()
    working = served.clients[-1]
    chain = working.hasher.keys(prompt(0, blocks=4))

    def lookup(_: int) -> None:
        found = working.lookup(chain)
        if found is not None:
            working.release(found)

    return {"engines": len(served.clients), "lookup_p50_us": timed_rounds({"lookup": lookup}, rounds)["lookup"][
        "p50_us"]}


def socket_echo_us(rounds: int) -> float:
    """The round trip's floor on this machine: 20 bytes echoed by a forked process over a Unix socket pair, p50."""
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # the echo: nothing but recv and send
        ours.close()
        while data := theirs.recv(ECHO_BYTES):
            theirs.sendall(data)
        os._exit(0)
    theirs.close()
    samples = []
    try:
        for index in range(rounds + rounds // 10):
            started = time.perf_counter()
            ours.sendall(b"x" * ECHO_BYTES)
            select.select([ours], [], [])
            ours.recv(ECHO_BYTES)
            if index >= rounds // 10:
                samples.append(time.perf_counter() - started)
    finally:
        ours.close()
        os.waitpid(child, 0)
    return statistics.median(samples) * US


def timed_rounds(paths: dict[str, Callable[[int], None]], rounds: int) -> dict[str, dict[str, float]]:
    """Each path once a round, in turn, after a tenth of the rounds untimed; p50 and p99 in µs."""
    warm = max(1, rounds // 10)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for index in range(warm + rounds):
        for name, path in paths.items():
            started = time.perf_counter()
            path(index)
            if index >= warm:
                samples[name].append(time.perf_counter() - started)
    return {name: {"p50_us": statistics.median(values) * US,
                   "p99_us": float(np.quantile(values, P99)) * US} for name, values in samples.items()}
