"""What a secondary tier adds to vLLM 0.33's scheduler step: µs per lookup, tiercache vs vLLM's fs tier.

vLLM asks each secondary tier about a waiting prompt's chunks one key at a time,
under its manager lock, every step until it has an answer; the tier must answer
from memory. Both tiers are built by vLLM's own ``TieringOffloadingSpec``
(through ``OffloadingSpecFactory``) and hold the prompt's chunks (tiercache in a
local ``redis-server``, fs in a temporary directory); per prompt (1k and 32k
tokens: 64 and 2048 chunks of 16 tokens) each repetition times, on the
scheduler's thread:

- ``first``: the lookups of a new request (every key unseen: RETRY, queued for
  the background presence check) and the step's ``on_schedule_end`` that sends the batch;
- ``answered``: the lookups once the presence check has answered (every key HIT).

The figure is µs per lookup (``first`` includes the flush, per key); tiers run
interleaved in one process, and the ratio tiercache / fs is of medians taken in
the same run. Run in the vLLM venv: ``.venv-vllm/bin/python benchmarks/vllm_lookup.py [--quick] [--out PATH]``.
It prints a table and writes ``vllm_lookup.json`` (with the load average).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from common import arguments, parse, write_result
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_offloading import Engine, chunk_keys, offloading_config, payloads, tier_config

TOKENS_PER_CHUNK = 16
PROMPTS = {"1k": 1024, "32k": 32 * 1024}
REPETITIONS = {"1k": 40, "32k": 8}
FS_THREADS = 4
"""Read and write threads of vLLM's fs tier (its default is 16 each; this machine has few cores)."""
ANSWER_TIMEOUT_S = 30.0
PRESENCE_CHECK_DEADLINE_MS = 5000.0
"""Generous: this measures the scheduler's side; a loaded 2-core box can take past the 200 ms default
to answer a 2048-key presence check, which would turn the answered step into misses."""
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
US_PER_NS = 1e-3
QUICK = {"PROMPTS": {"1k": 1024}, "REPETITIONS": {"1k": 2}}
"""The constants ``--quick`` replaces."""


def build(kind: str, server: RedisServer, root: str, chunks: int) -> Engine:
    if kind == "tiercache":
        options = {"url": server.url, "allow_unbounded": True}
        queues = {"remote_lookup_timeout_ms": PRESENCE_CHECK_DEADLINE_MS}
        topology = {"tiers": [{"name": "redis", "type": "redis", "options": options}], "queues": queues}
        tier = tier_config(topology)
    else:
        tier = {"type": "fs", "root_dir": root, "n_read_threads": FS_THREADS, "n_write_threads": FS_THREADS}
    return Engine(offloading_config([tier], num_chunks=chunks))


def answered(tier: SecondaryTierManager, keys: list, ctx: ReqContext) -> None:
    """Step (untimed) until the tier answers the prompt's last key."""
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while tier.lookup(keys[-1], ctx) is LookupResult.RETRY:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{type(tier).__name__} never answered")
        tier.on_schedule_end(STEP)
        time.sleep(0.001)


def one_request(tier: SecondaryTierManager, keys: list, index: int) -> tuple[float, float]:
    """µs per lookup of a new request's first step (with the flush) and of an answered step."""
    ctx = ReqContext(req_id=f"bench-{index}")
    lookup = tier.lookup
    started = time.perf_counter_ns()
    first = [lookup(key, ctx) for key in keys]
    tier.on_schedule_end(STEP)
    first_ns = time.perf_counter_ns() - started
    assert set(first) == {LookupResult.RETRY}, set(first)
    answered(tier, keys, ctx)
    started = time.perf_counter_ns()
    hits = [lookup(key, ctx) for key in keys]
    answered_ns = time.perf_counter_ns() - started
    assert set(hits) == {LookupResult.HIT}, (type(tier).__name__, set(hits))
    tier.on_request_finished(ctx)
    tier.on_schedule_end(STEP)
    return first_ns * US_PER_NS / len(keys), answered_ns * US_PER_NS / len(keys)


def measure(prompt: str, server: RedisServer, root: str) -> list[dict[str, Any]]:
    count = PROMPTS[prompt] // TOKENS_PER_CHUNK
    keys = chunk_keys(count, f"bench-{prompt}")
    engines = {kind: build(kind, server, root, count + 1) for kind in ("tiercache", "fs")}
    try:
        for engine in engines.values():
            engine.store(keys, payloads(count, engine.row_bytes, seed=count))
            engine.settle()
        samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in engines}
        for index in range(REPETITIONS[prompt]):
            for kind, engine in engines.items():
                (tier,) = engine.tiers
                with engine.manager.lock:
                    samples[kind].append(one_request(tier, keys, index))
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = []
    for kind, values in samples.items():
        rows.append(
            {
                "prompt": prompt,
                "chunks": count,
                "tier": kind,
                "first_us_per_lookup": statistics.median(v[0] for v in values),
                "answered_us_per_lookup": statistics.median(v[1] for v in values),
                "repetitions": len(values),
            }
        )
    fs = rows[1]
    for row in rows:
        row["first_vs_fs"] = row["first_us_per_lookup"] / fs["first_us_per_lookup"]
        row["answered_vs_fs"] = row["answered_us_per_lookup"] / fs["answered_us_per_lookup"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = f"{'prompt':<7}{'chunks':>7}  {'tier':<10}{'first µs/lookup':>16}{'vs fs':>7}"
    header += f"{'answered µs/lookup':>20}{'vs fs':>7}"
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['prompt']:<7}{row['chunks']:>7}  {row['tier']:<10}{row['first_us_per_lookup']:>16.2f}"
            f"{row['first_vs_fs']:>7.2f}{row['answered_us_per_lookup']:>20.2f}{row['answered_vs_fs']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(arguments(__doc__.splitlines()[0]), argv)
    if args.quick:
        globals().update(QUICK)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="vllm-fs-tier-") as root:
        for prompt in PROMPTS:
            rows += measure(prompt, server, root)
    load_after = os.getloadavg()
    print(table(rows))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    result = {"rows": rows, "loadavg_before": load_before, "loadavg_after": load_after}
    path = write_result(__file__, result, args.out, args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
