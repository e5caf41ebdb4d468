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
A third run has the cost model on and the remote recover halfway
(``RECOVERED_REMOTE``): the loads still bypassed after that are requests
recomputed while the remote was fast again. Prints a table and writes
cost_model.json next to this script.

    .venv/bin/python benchmarks/cost_model.py
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

from tiercache.config import config_from_dict
from tiercache.manager import TierManager
from tiercache.tools.simulate import SessionWorkload, simulate, summary_table, timed_requests
from tiercache.tools.workload import ChatWorkload

ENGINE_PREFILL_TOKENS_PER_S = 20_000.0
"""A modeled GPU engine's prefill rate (the TTFT model and the cost model use the same)."""
SLOW_REMOTE = {"latency_ms": 100.0, "bandwidth_mb_s": 0.0, "seed": 0}
RECOVERED_REMOTE_MS = 0.3
"""The remote's round trip once it recovers (a loopback Redis's order)."""
RECOVERY_AT = 0.5
"""Share of the requests served before the remote recovers, in the third run."""
LAYOUT = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": 16}
WORKLOAD = SessionWorkload(
    ChatWorkload(users=24, rounds=4, system_prompts=3, system_tokens=512, document_every=12, seed=0),
    think_time_s=30.0,
    arrival_spread_s=120.0,
)


def topology(cost: bool) -> dict[str, Any]:
    remote = {"name": "remote", "type": "simulated", "write_policy": "write_through", "options": SLOW_REMOTE}
    return {
        "model": {"id": "cost-model"},
        "layout": LAYOUT,
        "tiers": [
            {"name": "gpu", "type": "gpu", "capacity_blocks": 256, "options": {"device": "auto"}},
            {"name": "cpu", "type": "cpu", "capacity_blocks": 384},
            remote,
        ],
        "queues": {"max_pending_stores": 256},
        "cost": {"enabled": cost, "prefill_tokens_per_s": ENGINE_PREFILL_TOKENS_PER_S},
    }


def run(requests: list[Any], name: str, cost: bool, recovers: bool) -> tuple[Any, dict[str, Any]]:
    """One run through a fresh manager; with ``recovers`` the remote is fast from ``RECOVERY_AT`` on."""
    config = config_from_dict(copy.deepcopy(topology(cost)), source=name, environ={})
    switch_at = round(len(requests) * RECOVERY_AT) if recovers else None
    at_switch: dict[str, int] = {}
    with TierManager(config) as manager:

        def recover(done: int) -> None:
            if switch_at is not None and done >= switch_at and not at_switch:
                manager.remotes[0].options.latency_ms = RECOVERED_REMOTE_MS
                remote = manager.stats()["tiers"]["remote"]
                at_switch.update(bypassed=remote.get("bypassed_slower_than_recompute", 0), request=done)

        result = simulate(
            manager, requests, name=name, prefill_s_per_token=1 / ENGINE_PREFILL_TOKENS_PER_S, progress=recover
        )
    remote = result.stats["tiers"].get("remote", {})
    row = {
        **result.totals(),
        "bypassed_slower_than_recompute": remote.get("bypassed_slower_than_recompute", 0),
        "explored": remote.get("explored", 0),
        "transfer_ms_per_block": result.transfer_s_per_block,
    }
    if at_switch:
        row["recovered_at_request"] = at_switch["request"]
        row["bypassed_after_recovery"] = row["bypassed_slower_than_recompute"] - at_switch["bypassed"]
    return result, row


def main() -> None:
    requests = timed_requests(WORKLOAD)
    results, rows = [], {}
    for name, cost, recovers in (
        ("cost model off", False, False),
        ("cost model on", True, False),
        ("on, remote recovers", True, True),
    ):
        result, rows[name] = run(requests, name, cost, recovers)
        results.append(result)
    print(summary_table(results))
    for name, row in rows.items():
        print(f"{name}: {row['bypassed_slower_than_recompute']} remote loads bypassed, {row['explored']} explored")
        if "bypassed_after_recovery" in row:
            print(
                f"  the remote recovered after request {row['recovered_at_request']}: "
                f"{row['bypassed_after_recovery']} loads recomputed after that"
            )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f}")
    path = write_result(
        __file__,
        {
            "engine_prefill_tokens_per_s": ENGINE_PREFILL_TOKENS_PER_S,
            "remote": SLOW_REMOTE,
            "recovered_remote_latency_ms": RECOVERED_REMOTE_MS,
            "runs": rows,
            "load": load,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
