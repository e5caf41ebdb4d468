"""The ``asynchronous`` section of ``gpu_connector.py``: a step's loads copied beside the forward.

An asynchronous load (the connector's ``loads: async``, or ``auto`` beside a
running batch) is scattered into vLLM's blocks on the side stream, so the
compute stream never waits for it; a synchronous one makes the compute stream
wait before the scatter. Judged: the asynchronous load's pages byte-equal and
its job done; reported: a matmul's time on the compute stream with the load in
flight over its time alone, for each kind (CUDA only; goal for the asynchronous
one: at most ``GOAL_OVERLAP``), and the synchronizing calls of a step.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from gpu_connector_parts import Check, equal_pages, one_group, store_step

from tiercache.integrations.vllm.connector.transfers import GroupCopy


def asynchronous(check: Check, shape: dict[str, int], blocks: int, repeats: int,
                 overlap: Any) -> dict[str, Any]:
    """Pages stored from one cache, loaded asynchronously into a fresh one (``overlap``: ``gpu_connector.overlap``)."""
    kv = check.kv("LBNHC", shape, 2 * blocks)
    geometry = one_group(kv)
    region = check.region(2 * blocks, geometry.slot_bytes)
    storer = check.engine(geometry, kv, region, timed=True)
    slots, on, into = (check.scattered(blocks, 2 * blocks) for _ in range(3))
    store_step(storer, [GroupCopy(1, 0, slots, on)])
    stored = check.settle(storer)
    storer.close()
    fresh = {name: torch.zeros_like(view) for name, view in kv.items()}
    loader = check.engine(geometry, fresh, region, timed=True)
    failed = loader.load([GroupCopy(2, 0, slots, into)], asynchronous=True)
    loader.end_step([2], [])
    loaded = check.settle(loader)
    equal = equal_pages(kv, on, fresh, into)
    jobs = itertools.count(3)

    def load(asynchronously: bool) -> None:
        job = next(jobs)
        loader.load([GroupCopy(job, 0, slots, into)], asynchronous=asynchronously)
        loader.end_step([job], [])

    result = {
        "failed_at_once": failed, "store_done": stored.done, "load_done": loaded.done, "all_equal": equal,
        "async_overlap": overlap(check, loader, lambda: load(True), repeats),
        "sync_overlap": overlap(check, loader, lambda: load(False), repeats),
        "async_syncs_per_step": check.syncs(lambda: load(True)) if check.cuda else None,
    }
    check.settle(loader)
    loader.close()
    region.close()
    check.checks["asynchronous loads byte-equal, every job done"] = (
        not failed and stored.done == [1] and loaded.done == [2] and equal)
    if check.cuda:
        check.checks["no synchronizing call in an asynchronous load"] = result["async_syncs_per_step"] == 0
    return result
