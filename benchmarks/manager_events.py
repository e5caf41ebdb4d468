"""What KV events add to the engine-facing calls: µs per ``allocate`` and ``store``, events off vs on.

A GPU+CPU manager (CPU device standing in for the pool) serves a stream of
4-block prompts: ``allocate`` evicts and demotes (``BlockRemoved`` for the GPU,
``BlockStored`` for the CPU), ``store`` indexes (``BlockStored`` with tokens).
The ceiling is the same loop with events off, in the same run; with events on, a
ZeroMQ PUB socket on loopback publishes every batch. Median of ``--repeat``
rounds. Prints a table and writes manager_events.json next to this script.

    python benchmarks/manager_events.py [--requests 3000] [--repeat 3] [--quick] [--out PATH]
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
from common import arguments, parse, write_result

from tiercache.config import config_from_dict
from tiercache.manager.tier_manager import TierManager

LAYOUT = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16", "block_size": 16}
BLOCKS_PER_REQUEST = 4
MICRO = 1e6
QUICK_ARGUMENTS = {"requests": 100, "repeat": 1}
"""The defaults ``--quick`` gives the options."""


def topology(events: bool) -> dict[str, Any]:
    return {
        "model": {"id": "bench-events"},
        "layout": LAYOUT,
        "tiers": [
            {"type": "gpu", "capacity_blocks": 64, "options": {"device": "cpu"}},
            {"type": "cpu", "capacity_blocks": 256, "write_policy": "write_back"},
        ],
        "events": {"enabled": events, "endpoint": "tcp://127.0.0.1:*" if events else None},
    }


def one_round(events: bool, requests: int) -> tuple[float, float]:
    """Median µs per allocate and per store over ``requests`` prompts."""
    allocate_us, store_us = [], []
    with TierManager(config_from_dict(topology(events), environ={})) as manager:
        block = LAYOUT["block_size"]
        for request in range(requests):
            tokens = np.arange(BLOCKS_PER_REQUEST * block) + request * 100_000
            started = time.perf_counter()
            ids = manager.allocate(BLOCKS_PER_REQUEST)
            allocated = time.perf_counter()
            manager.store(tokens, ids)
            stored = time.perf_counter()
            manager.release(ids)
            allocate_us.append((allocated - started) * MICRO)
            store_us.append((stored - allocated) * MICRO)
    return statistics.median(allocate_us), statistics.median(store_us)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parse(parser, **QUICK_ARGUMENTS)
    rounds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.repeat):
        for events in (False, True):
            rounds[events].append(one_round(events, args.requests))
    medians = {
        events: tuple(statistics.median(values[i] for values in rounds[events]) for i in range(2))
        for events in rounds
    }
    print(f"{'call':<10}{'events off (ceiling)':>22}{'events on':>12}{'added':>10}")
    rows = {}
    for index, call in enumerate(("allocate", "store")):
        off, on = medians[False][index], medians[True][index]
        rows[call] = {"us_events_off": off, "us_events_on": on, "added_us": on - off}
        print(f"{call:<10}{off:>19.1f} µs{on:>9.1f} µs{on - off:>+8.1f} µs")
    load = os.getloadavg()
    print(f"{args.requests} requests of {BLOCKS_PER_REQUEST} blocks, median of {args.repeat}; load {load[0]:.2f}")
    result = {"requests": args.requests, "repeat": args.repeat, "calls": rows, "load": load}
    path = write_result(__file__, result, args.out, args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
