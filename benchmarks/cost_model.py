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
Prints a table and writes cost_model.json next to this script.

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


def main() -> None:
    requests = timed_requests(WORKLOAD)
    results, rows = [], {}
    for cost in (False, True):
        name = "cost model " + ("on" if cost else "off")
        config = config_from_dict(copy.deepcopy(topology(cost)), source=name, environ={})
        with TierManager(config) as manager:
            result = simulate(manager, requests, name=name, prefill_s_per_token=1 / ENGINE_PREFILL_TOKENS_PER_S)
        results.append(result)
        remote = result.stats["tiers"].get("remote", {})
        rows[name] = {
            **result.totals(),
            "bypassed_slower_than_recompute": remote.get("bypassed_slower_than_recompute", 0),
            "explored": remote.get("explored", 0),
            "transfer_ms_per_block": result.transfer_s_per_block,
        }
    print(summary_table(results))
    for name, row in rows.items():
        print(f"{name}: {row['bypassed_slower_than_recompute']} remote loads bypassed, {row['explored']} explored")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f}")
    path = write_result(
        __file__,
        {"engine_prefill_tokens_per_s": ENGINE_PREFILL_TOKENS_PER_S, "remote": SLOW_REMOTE, "runs": rows, "load": load},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
