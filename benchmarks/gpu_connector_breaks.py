"""The GPU check's guards broken on purpose (``--break NAME``), and what makes a broken one show (issue 53).

The guards of the connector's CUDA path, each with a way to break it:

- ``no-wait``: the side streams and the compute stream stop waiting for each
  other (``CopyStreams``' waits and events);
- ``no-record-stream``: staging let go is not marked for its stream first;
- ``one-stream``: loads and stores share one side stream;
- ``2d-runs``: a run of whole slots is one 2-D row again, past CUDA's maximum
  pitch at 2 GiB.

What makes a break show on a GPU is in every engine the check builds
(``gpu_connector_parts``: ``Widened`` delays the producer of each hand-over, a
step's staging is poisoned before it and what it let go is taken at once by a
poisoned allocation); here ``stream_order`` times a load behind a long store
and ``big_run`` copies a run past 2 GiB (on CPU: past a lowered pitch limit).
On CPU copies run at once, so only ``2d-runs`` can show there (``CPU_SHOWN``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from gpu_connector_parts import FULL, SMALL, Check, equal_pages, load_step, one_group, store_step

from tiercache.integrations.vllm.connector import staged
from tiercache.integrations.vllm.connector.cudart import MemcpyKind, checked
from tiercache.integrations.vllm.connector.pinning import copy_batch
from tiercache.integrations.vllm.connector.transfers import GroupCopy

BREAKS = ("no-wait", "no-record-stream", "one-stream", "2d-runs")
CPU_SHOWN = ("2d-runs",)
"""The breaks a CPU run can show (no streams there: copies are done at once)."""
STORE_DELAY_CYCLES = 400_000_000
"""``stream_order``'s store stream delay: about 200 ms, so a load queued behind it cannot end first."""
BIG_RUN_BYTES = 2 << 30
"""A run of whole slots at least this long: one 2-D row of it passes CUDA's maximum pitch (2**31 - 1)."""
ORDER_WAIT_S = 5.0
"""How long ``stream_order`` polls for the load (a hang guard, not a figure)."""


def break_runs() -> None:
    """``2d-runs``: whole-slot runs sent as one 2-D row each, as before the fix."""
    def one_row(runtime: Any, kind: MemcpyKind, stream: int, max_pitch: int, rows: torch.Tensor,
                shares: torch.Tensor, runs: Any) -> None:
        width, pitch = rows.shape[1], shares.stride(0)
        if pitch != width:
            copy_batch(runtime, kind, stream, max_pitch, rows, shares, runs)
            return
        for position, slot, count in runs:
            device, host = rows.data_ptr() + position * width, shares.data_ptr() + slot * pitch
            dst, src = (device, host) if kind is MemcpyKind.HOST_TO_DEVICE else (host, device)
            size = width * count
            checked(runtime, runtime.memcpy_2d(dst, size, src, size, size, 1, kind, stream), "a 2-D row")

    staged.copy_batch = one_row  # type: ignore[assignment]


def stream_order(check: Check) -> dict[str, Any]:
    """A load queued after a long store ends first: loads and stores run on their own streams (CUDA only)."""
    if not check.cuda:
        return {"skipped": "no streams on CPU"}
    kv = check.kv("LBNHC", SMALL, 32)
    geometry = one_group(kv)
    region = check.region(32, geometry.slot_bytes)
    copies = check.engine(geometry, kv, region)
    store_step(copies, [GroupCopy(1, 0, tuple(range(8)), tuple(range(8)))])
    check.settle(copies)
    with copies.streams.on(MemcpyKind.DEVICE_TO_HOST):
        torch.cuda._sleep(STORE_DELAY_CYCLES)
    store_step(copies, [GroupCopy(2, 0, tuple(range(8, 16)), tuple(range(8, 16)))])
    load_step(copies, [GroupCopy(3, 0, tuple(range(8)), tuple(range(16, 24)))])
    done: list[int] = []
    deadline = time.monotonic() + ORDER_WAIT_S
    while 3 not in done and time.monotonic() < deadline:
        done += copies.poll().done
    store_open = 2 not in done
    check.settle(copies)
    copies.close()
    region.close()
    check.checks["a load ends while an earlier store is still copying"] = 3 in done and store_open
    return {"load_done": 3 in done, "store_in_flight_then": store_open}


def big_run(check: Check) -> dict[str, Any]:
    """A store and a load of one run of consecutive whole slots past 2 GiB (CPU: past a lowered pitch limit)."""
    limit = None
    if check.cuda:
        per_block = FULL["layers"] * FULL["heads"] * FULL["tokens"] * FULL["content"]  # 2 MiB
        blocks = BIG_RUN_BYTES // per_block + 1
        kv = check.kv("LBNHC", FULL, blocks)
    else:
        blocks = 4
        kv = check.kv("LBNHC", SMALL, blocks)
        limit, check.runtime.pitch_limit = check.runtime.pitch_limit, 2 * sum(v[0].numel() for v in kv.values())
    try:
        geometry = one_group(kv)
        region = check.region(blocks, geometry.slot_bytes)
        copies = check.engine(geometry, kv, region)
        run = tuple(range(blocks))
        stored = store_step(copies, [GroupCopy(1, 0, run, run)]) == [] and check.settle(copies).done == [1]
        other = {name: torch.zeros_like(view) for name, view in kv.items()}
        loader = check.engine(geometry, other, region)
        copies.close()
        loaded = load_step(loader, [GroupCopy(2, 0, run, run)]) == [] and check.settle(loader).done == [2]
        equal = stored and loaded and equal_pages(kv, run, other, run)
        loader.close()
        region.close()
    finally:
        if limit is not None:
            check.runtime.pitch_limit = limit
    check.checks["a run of whole slots past the maximum pitch, both ways"] = equal
    return {"blocks": blocks, "bytes": blocks * geometry.slot_bytes, "stored": stored, "loaded": loaded,
            "equal": equal}
