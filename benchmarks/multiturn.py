"""Multi-turn chat through several topologies and eviction policies, side by side, in one run.

The workload: many users in sessions of several rounds that share a few system
prompts, think between rounds (simulated time), and one-off long documents that
arrive now and then (a scan that a policy should not let flush the hot set). Each
user's turns take their lengths from a ShareGPT conversation (its questions and
recorded answers, counted with SmolLM2's tokenizer, each clipped to
``MAX_MESSAGE_TOKENS``; ``tiercache.tools.conversations.sharegpt_turn_tokens``);
the token ids themselves are synthetic, so every block can be checked. Each
configuration gets a fresh manager and the same requests; every reused block is
checked against recomputation.

Reported per configuration: tokens reused per tier, prefill tokens saved, a TTFT
model (computed tokens x the reference transformer's measured prefill cost per
token on this machine + loaded blocks x each tier's measured transfer cost per
block) and throughput (wall clock of the run, and prefill tokens per modeled
second). Writes ``multiturn.json`` next to this file, and with matplotlib (the
``bench`` extra) ``multiturn_hit_ratio.png`` and ``multiturn_ttft.png``.

The oracle table puts each run's prefill saved against Belady's at the run's
capacity (GPU plus CPU blocks) and against its policy alone: the same policy as one
cache of that capacity on the same requests, which tells what the policy can do on
this workload from what the tiers add or lose (an inclusive CPU tier holds copies
of the GPU's blocks, so the hierarchy holds fewer distinct blocks than its capacity).

Configurations: every policy registered in ``tiercache.policies.POLICIES`` on a
small GPU pool over a pinned-CPU tier; a GPU-only pool (no lower tier); and the
GPU+CPU topology over a ``simulated`` remote whose link is the Redis tier as this
repository measured it on loopback (``SIMULATED_REMOTE``: the figures and the
results they come from). With ``--redis-url`` a real Redis tier is added as one
more configuration.

    .venv/bin/python benchmarks/multiturn.py            # default: about two minutes on 2 cores
    .venv/bin/python benchmarks/multiturn.py --quick    # a tiny workload, seconds (figures mean nothing)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import libcachesim as lcs
import oracle as oracle_module
import torch
from common import arguments, parse, result_path

from tiercache.blocks.keys import BlockHasher, Namespace
from tiercache.config import config_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.policies import POLICIES, keyed_policy
from tiercache.testing.policy_traces import write_oracle_general
from tiercache.testing.real_model import build_smollm2
from tiercache.tools.conversations import sharegpt_turn_tokens
from tiercache.tools.sharegpt import read_conversations
from tiercache.tools.simulate import (
    Progress,
    SessionWorkload,
    SimulationResult,
    measure_prefill_cost,
    simulate,
    summary_table,
    timed_requests,
    write_plots,
)
from tiercache.tools.workload import ChatWorkload

LAYOUT = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": 16}
GPU_BLOCKS = 384
"""Small enough that the sessions' working set does not fit, so the lower tiers matter."""
CPU_BLOCKS = 1536
REDIS_GET_MB_S = 2561.0
"""The Redis tier's GET of 64 KiB values, one call of 64 at a time, on one loopback redis-server: 2.56 GB/s in
``benchmarks/remote.json`` (the row ``single``, ``64KiB``, ``GET``: ``tier_gbps``; docs/benchmarks.md, "Redis
tier"), the measured value size nearest below this layout's 128 KiB blocks."""
REDIS_CALL_MS = 0.2
"""A GET call's fixed cost: ``benchmarks/sync.json``'s ``redis tier GET (ceiling)`` row (one call of 32 x 64 KiB,
p50 1.02 ms; docs/benchmarks.md, "Central/regional sync") less its 2 MiB at ``REDIS_GET_MB_S`` (0.82 ms)."""
SIMULATED_REMOTE = {"latency_ms": REDIS_CALL_MS, "bandwidth_mb_s": REDIS_GET_MB_S, "seed": 0}
"""The simulated remote's link: a call's round trip plus its bytes at the rate the Redis tier reads here."""
WORKLOAD = SessionWorkload(
    ChatWorkload(
        users=40,
        rounds=5,
        system_prompts=4,
        system_tokens=512,
        document_every=12,
        document_tokens=2048,
        seed=0,
    ),
    think_time_s=30.0,
    arrival_spread_s=120.0,
)
QUICK_WORKLOAD = SessionWorkload(
    ChatWorkload(users=4, rounds=2, system_prompts=2, system_tokens=128, document_every=4, document_tokens=256),
    think_time_s=5.0,
    arrival_spread_s=10.0,
)
MAX_MESSAGE_TOKENS = 1024
"""A turn's message or reply is clipped to this many tokens (a few ShareGPT messages are whole files)."""
QUICK = {"GPU_BLOCKS": 24, "CPU_BLOCKS": 48, "MAX_MESSAGE_TOKENS": 96}
"""``--quick``: every configuration and the oracle on a handful of requests, in tiers small enough that the
lower ones serve some of them."""


def with_sharegpt_turns(workload: SessionWorkload) -> SessionWorkload:
    """``workload`` with each user's turn lengths taken from a ShareGPT conversation (SmolLM2's tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_smollm2())
    chat = workload.chat
    turns = sharegpt_turn_tokens(read_conversations(), lambda text: len(tokenizer(text)["input_ids"]),
                                 users=chat.users, rounds=chat.rounds, max_message_tokens=MAX_MESSAGE_TOKENS)
    return dataclasses.replace(workload, chat=dataclasses.replace(chat, turn_tokens=turns))


def topology(name: str, policy: str, lower: bool, remote: dict[str, Any] | None = None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"name": "gpu", "type": "gpu", "capacity_blocks": GPU_BLOCKS, "policy": policy, "options": {"device": "auto"}}
    ]
    if lower:
        tiers.append({"name": "cpu", "type": "cpu", "capacity_blocks": CPU_BLOCKS, "policy": policy})
    if remote is not None:
        tiers.append(remote)
    return {"model": {"id": f"multiturn-{name}"}, "layout": LAYOUT, "tiers": tiers}


def configurations(redis_url: str | None) -> dict[str, dict[str, Any]]:
    """Name -> raw topology: the policy comparison first, then the topology comparison."""
    runs = {f"gpu+cpu {policy}": topology(policy, policy, lower=True) for policy in POLICIES}
    runs["gpu only lru"] = topology("gpu-only", "lru", lower=False)
    simulated = {"name": "remote", "type": "simulated", "write_policy": "write_back", "options": SIMULATED_REMOTE}
    runs["gpu+cpu+simulated lru"] = topology("simulated", "lru", lower=True, remote=simulated)
    if redis_url:
        redis = {"name": "redis", "type": "redis", "write_policy": "write_back", "options": {"url": redis_url}}
        runs["gpu+cpu+redis lru"] = topology("redis", "lru", lower=True, remote=redis)
    return runs


def oracle(requests: list[Any], configs: dict[str, dict[str, Any]], block_size: int) -> dict[str, Any]:
    """Belady's prefill saved per topology capacity, checked against libCacheSim's Belady on the same trace,
    and each run's policy alone: one cache of the run's capacity on the same requests."""
    ids: dict[bytes, int] = {}
    hasher = BlockHasher(Namespace("oracle", "layout"), block_size)
    blocks = [[ids.setdefault(key, len(ids) + 1) for key in hasher.keys(r.tokens)] for r in requests]
    prompt_tokens = sum(len(r.tokens) for r in requests)
    capacities = {name: capacity_of(raw) for name, raw in configs.items()}
    rows: dict[str, Any] = {}
    for capacity in sorted(set(capacities.values())):
        saved = sum(oracle_module.prefix_saved_blocks(blocks, capacity)) * block_size
        rows[str(capacity)] = {"capacity_blocks": capacity, "prefill_saved_share": saved / prompt_tokens}
    alone = {
        name: policy_alone_saved(blocks, raw["tiers"][0]["policy"], capacities[name]) * block_size / prompt_tokens
        for name, raw in configs.items()
        if math.isfinite(capacities[name])
    }
    trace = [block for request in blocks for block in request]
    check_capacity = GPU_BLOCKS
    with tempfile.TemporaryDirectory() as directory:
        path = write_oracle_general(trace, Path(directory) / "multiturn.oracleGeneral.bin")
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        theirs = lcs.Belady(check_capacity).process_trace(reader)[0]
    ours = oracle_module.plain_miss_ratio(trace, check_capacity)
    return {
        "by_capacity": rows,
        "capacity_of_run": {name: str(capacity) for name, capacity in capacities.items()},
        "policy_alone_saved_share": alone,
        "check": {"capacity_blocks": check_capacity, "ours_miss_ratio": ours, "libcachesim_belady_miss_ratio": theirs},
    }


def policy_alone_saved(requests: list[list[int]], policy: str, capacity: float) -> int:
    """Blocks of prefill saved by ``policy`` as one cache of ``capacity`` blocks, served as the pool serves them.

    A request saves its longest cached prefix; then the policy sees its blocks tail first, each
    access before a victim is picked (libCacheSim's order), and never evicts a block of the
    request itself (the engine holds them).
    """
    cache = keyed_policy(policy, int(capacity))
    saved = 0
    for request in requests:
        saved += next((i for i, block in enumerate(request) if block not in cache), len(request))
        in_request = set(request).__contains__
        for block in reversed(request):
            if cache.access(block):
                continue
            while len(cache) >= cache.capacity:
                cache.evict(lambda key, held=in_request: not held(key), incoming=block)
            cache.insert(block)
    return saved


def capacity_of(raw: dict[str, Any]) -> float:
    """Blocks a topology can hold locally; a remote tier without a capacity makes it unbounded."""
    total = 0.0
    for tier in raw["tiers"]:
        if tier["type"] in ("gpu", "cpu"):
            total += tier["capacity_blocks"]
        elif not tier.get("options", {}).get("capacity_blocks"):
            return math.inf
    return total


def oracle_table(results: list[SimulationResult], found: dict[str, Any]) -> str:
    """Prefill saved per run against Belady's at its capacity, and against its policy alone as one cache."""
    lines = [f"{'run':<28}{'capacity':>10}{'saved':>8}{'oracle':>8}{'of oracle':>10}{'alone':>8}{'of alone':>9}"]
    for result in results:
        key = found["capacity_of_run"][result.name]
        best = found["by_capacity"][key]["prefill_saved_share"]
        saved = result.totals()["prefill_saved_share"]
        alone = found["policy_alone_saved_share"].get(result.name)
        versus = f"{alone:>8.1%}{saved / alone:>9.2f}" if alone else f"{'-':>8}{'-':>9}"
        lines.append(f"{result.name:<28}{key:>10}{saved:>8.1%}{best:>8.1%}{saved / best if best else 0:>10.2f}{versus}")
    check = found["check"]
    lines.append(
        f"oracle check at {check['capacity_blocks']} blocks: miss ratio {check['ours_miss_ratio']:.6f} "
        f"(libCacheSim Belady {check['libcachesim_belady_miss_ratio']:.6f})"
    )
    return "\n".join(lines)


def run(
    workload: SessionWorkload, redis_url: str | None, out: Path, plots: bool, quick: bool = False
) -> list[SimulationResult]:
    requests = timed_requests(workload)
    configs = configurations(redis_url)
    layout = config_from_dict(next(iter(configs.values())), environ={}).layout
    prefill = measure_prefill_cost(layout)
    print(
        f"{len(requests)} requests, {sum(len(r.tokens) for r in requests)} prompt tokens; "
        f"{len(configs)} configurations; prefill {1000 * prefill:.3f} ms/token (reference model)"
    )
    results = []
    for name, raw in configs.items():
        config = config_from_dict(copy.deepcopy(raw), source=name, environ={})
        with TierManager(config) as manager:
            progress = Progress(len(requests), f"{name:<24}")
            results.append(
                simulate(manager, requests, name=name, prefill_s_per_token=prefill, progress=progress.update)
            )
    print(summary_table(results))
    found = oracle(requests, configs, layout.block_size)
    print(oracle_table(results, found))
    document = {
        "benchmark": "multiturn",
        "quick": quick,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "workload": {"chat": vars(workload.chat), **{k: v for k, v in vars(workload).items() if k != "chat"}},
        "topologies": configs,
        "runs": [result.to_json() for result in results],
        "oracle": found,
    }
    out.write_text(json.dumps(document, indent=1, default=str))
    print(f"wrote {out}")
    if plots:
        for path in write_plots(results, out.with_suffix("")):
            print(f"wrote {path}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--redis-url", help="add a configuration with a real Redis tier, e.g. redis://127.0.0.1:6379")
    parser.add_argument("--no-plots", action="store_true", help="no PNGs (they go next to the JSON)")
    args = parse(parser, argv)
    workload = WORKLOAD
    if args.quick:
        workload = QUICK_WORKLOAD
        globals().update(QUICK)
    workload = with_sharegpt_turns(workload)
    results = run(workload, args.redis_url, result_path(__file__, args.out), not args.no_plots, args.quick)
    return 0 if all(result.mismatched_blocks == 0 for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
