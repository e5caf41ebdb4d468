"""A remote slower than recomputing: multi-turn chat with and without the cost model, in one run.

The engine is modeled as a GPU prefilling ``ENGINE_PREFILL_TOKENS_PER_S`` tokens a
second (a 16-token block recomputes in under a millisecond); the remote is a
``simulated`` tier behind a cross-region link (``SLOW_REMOTE``: 100 ms a request).
Both runs serve the same requests through GPU + CPU + that remote; the second
turns the cost model on (``cost: {enabled: true}``), so a lookup stops its prefix
before the remote's part whenever fetching it would take longer than recomputing
it. Reported: tokens reused per tier, prefill saved, and the modeled TTFT
(computed tokens x the engine's prefill cost + loaded blocks x each tier's
measured transfer cost per block), with the share of remote loads bypassed.
A third run has the cost model on and the remote's round trip recover halfway
(``RECOVERED_REMOTE_MS``): the loads still bypassed after that are requests
recomputed while the remote was fast again. A fourth run keeps the round trip
short and slows the link instead (``SLOW_LINK_MB_S``), recovering halfway: only
fetches show that, so only explorations find it. Per run, each request's load is
watched (the lookup it commits): the requests whose load fetched an exploration
(waited on the experiment), and, after a recovery, those that still recomputed
the remote's part and the last of them (counted among the requests that weighed
the remote). Prints a table and writes cost_model.json next to this script.

    .venv/bin/python benchmarks/cost_model.py [--quick] [--out PATH]
"""

from __future__ import annotations

import copy
import os
from typing import Any

from common import arguments, parse, write_result

from tiercache.config import config_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.tools.simulate import SessionWorkload, simulate, summary_table, timed_requests
from tiercache.tools.workload import ChatWorkload

ENGINE_PREFILL_TOKENS_PER_S = 20_000.0
"""A modeled GPU engine's prefill rate (the TTFT model and the cost model use the same)."""
SLOW_REMOTE = {"latency_ms": 100.0, "bandwidth_mb_s": 0.0, "seed": 0}
RECOVERED_REMOTE_MS = 0.3
"""The remote's round trip once it recovers (a loopback Redis's order)."""
RECOVERY_AT = 0.5
"""Share of the requests served before the remote recovers, in the third and fourth runs."""
SLOW_LINK_MB_S = 20.0
"""The fourth run's link until it recovers (to unlimited): a 16-token block (128 KiB) takes 6.6 ms on it,
eight times its recompute; the round trip stays ``RECOVERED_REMOTE_MS``."""
LAYOUT = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": 16}
WORKLOAD = SessionWorkload(
    ChatWorkload(users=24, rounds=4, system_prompts=3, system_tokens=512, document_every=12, seed=0),
    think_time_s=30.0,
    arrival_spread_s=120.0,
)
GPU_BLOCKS = 256
CPU_BLOCKS = 384
QUICK = {
    "WORKLOAD": SessionWorkload(
        ChatWorkload(users=6, rounds=3, system_prompts=2, system_tokens=128, document_every=6, document_tokens=256),
        think_time_s=5.0,
        arrival_spread_s=10.0,
    ),
    "GPU_BLOCKS": 40,
    "CPU_BLOCKS": 16,
    "SLOW_REMOTE": {**SLOW_REMOTE, "latency_ms": 10.0},
}
"""The constants ``--quick`` replaces: a few requests, in local tiers small enough that the remote serves some,
and a remote still slower than recomputing but 10 ms away instead of 100."""


def topology(cost: bool, options: dict[str, Any]) -> dict[str, Any]:
    remote = {"name": "remote", "type": "simulated", "write_policy": "write_through", "options": options}
    return {
        "model": {"id": "cost-model"},
        "layout": LAYOUT,
        "tiers": [
            {"name": "gpu", "type": "gpu", "capacity_blocks": GPU_BLOCKS, "options": {"device": "auto"}},
            {"name": "cpu", "type": "cpu", "capacity_blocks": CPU_BLOCKS},
            remote,
        ],
        "queues": {"max_pending_stores": 256},
        "cost": {"enabled": cost, "prefill_tokens_per_s": ENGINE_PREFILL_TOKENS_PER_S},
    }


def watch_loads(manager: TierManager) -> list[tuple[str | None, bool]]:
    """Per request, in order: the cost model's verdict on the remote (None: not weighed) and whether the
    request's load asked the remote for blocks. Each load commits its lookup once (the manager's lookup
    part); the list grows as the run goes."""
    lookup = manager.parts.lookup
    seen: list[tuple[str | None, bool]] = []
    commit = lookup.commit

    def watched(found: Any, keys: Any) -> None:
        verdict = dict(found.learned.verdicts).get("remote")
        seen.append((verdict.value if verdict is not None else None, "remote" in found.tiers))
        commit(found, keys)

    lookup.commit = watched
    return seen


def run(requests: list[Any], name: str, cost: bool, recovery: str | None) -> tuple[Any, dict[str, Any]]:
    """One run through a fresh manager; ``recovery`` "round trip" or "link": that is slow until ``RECOVERY_AT``."""
    options = {**SLOW_REMOTE, "latency_ms": RECOVERED_REMOTE_MS, "bandwidth_mb_s": SLOW_LINK_MB_S}
    config = config_from_dict(
        copy.deepcopy(topology(cost, options if recovery == "link" else SLOW_REMOTE)), source=name, environ={}
    )
    switch_at = round(len(requests) * RECOVERY_AT) if recovery else None
    at_switch: dict[str, int] = {}
    with TierManager(config) as manager:
        loads = watch_loads(manager)

        def recover(done: int) -> None:
            if switch_at is not None and done >= switch_at and not at_switch:
                remote = manager.parts.remotes[0].options
                remote.latency_ms, remote.bandwidth_mb_s = RECOVERED_REMOTE_MS, 0.0
                at_switch.update(request=done, load=len(loads))

        result = simulate(
            manager, requests, name=name, prefill_s_per_token=1 / ENGINE_PREFILL_TOKENS_PER_S, progress=recover
        )
    remote = result.stats["tiers"].get("remote", {})
    row = {
        **result.totals(),
        "bypassed_slower_than_recompute": remote.get("bypassed_slower_than_recompute", 0),
        "explored": remote.get("explored", 0),
        "requests_waited_on_exploration": sum(verdict == "explore" and asked for verdict, asked in loads),
        "transfer_ms_per_block": result.transfer_s_per_block,
    }
    if at_switch:
        weighed = [(verdict, asked) for verdict, asked in loads[at_switch["load"] :] if verdict is not None]
        recomputed = [i for i, (_, asked) in enumerate(weighed) if not asked]
        row["recovered_at_request"] = at_switch["request"]
        row["remote_weighed_after_recovery"] = len(weighed)
        row["recomputed_after_recovery"] = len(recomputed)
        row["last_recomputed_after_recovery"] = recomputed[-1] + 1 if recomputed else 0
    return result, row


def main() -> None:
    args = parse(arguments(__doc__.splitlines()[0]))
    if args.quick:
        globals().update(QUICK)
    requests = timed_requests(WORKLOAD)
    results, rows = [], {}
    for name, cost, recovery in (
        ("cost model off", False, None),
        ("cost model on", True, None),
        ("on, round trip recovers", True, "round trip"),
        ("on, link recovers", True, "link"),
    ):
        result, rows[name] = run(requests, name, cost, recovery)
        results.append(result)
    print(summary_table(results))
    for name, row in rows.items():
        print(
            f"{name}: {row['bypassed_slower_than_recompute']} remote loads bypassed, {row['explored']} explored, "
            f"{row['requests_waited_on_exploration']} requests waited on an exploration"
        )
        if "recomputed_after_recovery" in row:
            print(
                f"  the remote recovered after request {row['recovered_at_request']}: of the "
                f"{row['remote_weighed_after_recovery']} requests that weighed it after that, "
                f"{row['recomputed_after_recovery']} recomputed its part, the last one the "
                f"{row['last_recomputed_after_recovery']}th"
            )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f}")
    path = write_result(
        __file__,
        {
            "engine_prefill_tokens_per_s": ENGINE_PREFILL_TOKENS_PER_S,
            "remote": SLOW_REMOTE,
            "recovered_remote_latency_ms": RECOVERED_REMOTE_MS,
            "slow_link_mb_s": SLOW_LINK_MB_S,
            "runs": rows,
            "load": load,
        },
        args.out,
        args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
