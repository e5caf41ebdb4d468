"""The vLLM connector's GPU transfer engine, torch only (no vLLM, no xxhash): a check that cannot pass while the path
is broken.

Run by ``scripts/gpu_check_connector.sh`` on a CUDA machine (one H100 or H200, a
few minutes); ``--device cpu --quick`` runs it on CPU tensors in the main suite,
the CUDA runtime's calls answered on host memory (``HostRuntime``), so every
path but the device's own runs before a GPU is lent. KV caches are built as
vLLM 0.33 builds them (one allocation, the logical ``[L, B, H, N, C]`` shape, a
stride permutation per ``KVCacheLayout``; an 8B model's shape: 32 layers, 8 KV
heads, 16 tokens, bf16 head 128, a block's pages of every layer 2 MiB) and
moved by the connector's own ``StagedTransfers`` over real regions
(``SharedRegion`` files in ``/dev/shm``), one engine per region at a time
(closed, so unregistered, before the next), slots and blocks scattered:

- ``layouts``: each layout stored from and loaded into each (36 pairs), every
  page compared in vLLM's logical order; every engine pinned;
- ``steps``: per layout and direction a step of ``--blocks`` blocks: GB/s (only
  when every job of the step reported done) against one contiguous pinned copy
  of the same bytes, compute overlap (a matmul on the compute stream with the
  step's store copies in flight, over the matmul alone), synchronizing calls per
  step (torch's sync debug mode as warnings: counted even where the engine's
  own error handling would swallow what the "error" mode raises); the same for
  a region whose registration is refused (copies through bounce buffers);
- ``tp2``: two engines (ranks 0 and 1) over one region, each pinning only its
  shares, byte-equal both ways;
- ``hybrid``: two KV-cache groups; a job failing in one group (a block that is
  none, a slot that is none) reported failed once, only after its other group's
  copies ended, the others byte-equal;
- ``asynchronous``: a step's loads copied beside the forward (scattered on the
  side stream), byte-equal; a matmul's time with them in flight against a
  synchronous load's (``gpu_connector_async.py``);
- ``worker_order``: the connector's ``ConnectorWorker`` driven in vLLM's V1
  call order and in its speculative-decoding order, the forward faked as
  delayed kernels on the compute stream (``gpu_connector_worker.py``): the
  pages a load's forward reads equal what the store's forward wrote, a failed
  load's blocks are errors in its step, every job is reported once;
- ``injected``: a refused registration (the region registered already: CUDA's
  own refusal), a failing copy (a direction that is none, through the runtime
  seam), a region larger than its directory's free space, and (CUDA) a
  synchronizing call planted in the engine's error handling: each must be caught,
  and after each a kernel launch must still work (no error left set).

Prints one table and each check's verdict, writes ``gpu_connector.json`` (to
``--out``; the engine's own log beside it, ``gpu_connector_engine.log``) and exits
1 if a check failed. Figures come only from a GPU run; none are committed
without one. The parts it builds are in ``gpu_connector_parts.py``.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch
from common import arguments, parse, result_path, write_result
from gpu_connector_async import asynchronous
from gpu_connector_breaks import BREAKS, big_run, break_runs, stream_order
from gpu_connector_parts import (
    FULL,
    LAYOUTS,
    SMALL,
    TP_LAYERS,
    Check,
    FailingCopies,
    Held,
    Syncing,
    equal_pages,
    load_step,
    one_group,
    store_step,
)
from gpu_connector_worker import worker_order

from tiercache.integrations.vllm.connector.cudart import MemcpyKind
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.pinning import PinScope
from tiercache.integrations.vllm.connector.region import RegionSpaceError, SharedRegion
from tiercache.integrations.vllm.connector.shmfile import free_bytes
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy

GOAL_RATIO, GOAL_OVERLAP, GOAL_SYNCS = 0.9, 1.1, 0
"""Goals: a step's GB/s over a contiguous pinned copy's (judged on CUDA, pinned steps of 2 MiB pages), a matmul's
time with a step's store copies in flight over its time alone (reported); synchronizing calls per step (judged:
0)."""


def layouts(check: Check, blocks: int) -> dict[str, Any]:
    """Each layout stored, then loaded into each other one over the same region, one engine at a time."""
    unequal, unpinned, failed = [], 0, 0
    for source in LAYOUTS:
        kv = check.kv(source, SMALL, 2 * blocks)
        geometry = one_group(kv)
        region = check.region(4 * blocks, geometry.slot_bytes)
        job = GroupCopy(1, 0, check.scattered(blocks, 4 * blocks), check.scattered(blocks, 2 * blocks))
        copies = check.engine(geometry, kv, region)
        unpinned += not copies.pinned
        store_step(copies, [job])
        failed += len(check.settle(copies).failed)
        copies.close()
        for target in LAYOUTS:
            other = check.kv(target, SMALL, 2 * blocks)
            loader = check.engine(geometry, other, region)
            unpinned += not loader.pinned
            into = check.scattered(blocks, 2 * blocks)
            load_step(loader, [GroupCopy(2, 0, job.slots, into)])
            failed += len(check.settle(loader).failed)
            loader.close()
            if not equal_pages(kv, job.blocks, other, into):
                unequal.append(f"{source}->{target}")
        region.close()
    pairs = len(LAYOUTS) ** 2
    check.checks["layouts byte-equal"] = not unequal and not failed
    check.checks["every engine pinned (closed engines unregistered)"] = unpinned == 0
    return {"pairs": pairs, "all_equal": not unequal, "unequal": unequal, "unpinned_engines": unpinned,
            "failed_jobs": failed}


def step_rows(check: Check, layout: str, shape: dict[str, int], blocks: int, repeats: int,
              refused: bool = False) -> list[dict[str, Any]]:
    """A step's store and load of ``blocks`` scattered blocks, against one contiguous pinned copy (``refused``: the
    region pinned by someone else first, so the engine's registration is refused and it copies through bounce
    buffers)."""
    kv = check.kv(layout, shape, 2 * blocks)
    geometry = one_group(kv)
    region = check.region(2 * blocks, geometry.slot_bytes)
    base, size = region.slots.data_ptr(), region.slots.numel()
    if refused:
        assert check.runtime.host_register(base, size) == 0, "pinning the region first"
    copies = check.engine(geometry, kv, region, timed=True)
    slots, on = check.scattered(blocks, 2 * blocks), check.scattered(blocks, 2 * blocks)
    steps = {"store": (1, lambda: store_step(copies, [GroupCopy(1, 0, slots, on)])),
             "load": (2, lambda: load_step(copies, [GroupCopy(2, 0, slots, on)]))}
    nbytes = blocks * geometry.slot_bytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=check.cuda)
    device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=check.device)
    ceilings = {"store": check.timed(lambda: pinned.copy_(device_bytes, non_blocking=True), repeats),
                "load": check.timed(lambda: device_bytes.copy_(pinned, non_blocking=True), repeats)}
    rows = []
    for direction, (job, launch) in steps.items():
        done = Completed()
        seconds = check.timed(lambda launch=launch, done=done: (launch(), done.add(check.settle(copies))), repeats)
        ok = not done.failed and done.done.count(job) == repeats + 1  # every step's job reported done
        syncs = check.syncs(lambda launch=launch, done=done: (launch(), done.add(copies.poll())))
        done.add(check.settle(copies))
        ok &= not done.failed and done.done.count(job) == repeats + 2
        rows.append({"section": "steps", "layout": f"{layout} (pageable)" if refused else layout,
                     "direction": direction, "blocks": blocks, "bytes": nbytes, "pinned": copies.pinned,
                     "jobs_ok": ok, "gbps": nbytes / seconds / 1e9 if ok else None,
                     "ceiling_gbps": nbytes / ceilings[direction] / 1e9,
                     "ratio": ceilings[direction] / seconds if ok else None,
                     "overlap": overlap(check, copies, steps["store"][1], repeats) if direction == "store" else None,
                     "syncs_per_step": syncs})
    copies.close()
    if refused:
        check.checks["a refused registration: pageable, its error cleared, a launch works"] = (
            not copies.pinned and check.runtime.last_error() == 0 and check.launch_works())
        check.runtime.host_unregister(base)
    region.close()
    return rows


def overlap(check: Check, copies: StagedTransfers, store: Callable[[], object], repeats: int) -> float | None:
    """A matmul's time on the compute stream with a step's store copies in flight, over its time alone (None: CPU)."""
    if not check.cuda:
        return None
    a = torch.randn(8192, 8192, device=check.device, dtype=torch.bfloat16)

    def compute_ms(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            run()  # the store's gathers, on the compute stream, before the timed matmul
            start.record()
            a @ a
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            check.settle(copies)
        return statistics.median(times)

    alone = compute_ms(lambda: None)
    with_copies = compute_ms(store)
    return with_copies / alone


def tp2(check: Check, blocks: int) -> dict[str, Any]:
    """Ranks 0 and 1 over one region (one mapping, one runtime): each pins only its shares, stores its pages, loads
    them back into fresh blocks."""
    shape = {**FULL, "layers": TP_LAYERS}
    caches = [check.kv("LBNHC", shape, 2 * blocks) for _ in range(2)]
    geometry = one_group(caches[0], world=2)
    region = check.region(2 * blocks, geometry.slot_bytes)
    ranks = [check.engine(geometry, caches[rank], region, rank) for rank in range(2)]
    slots, on, into = (check.scattered(blocks, 2 * blocks) for _ in range(3))
    failed = 0
    for copies in ranks:
        store_step(copies, [GroupCopy(1, 0, slots, on)])
        failed += len(check.settle(copies).failed)
    fresh = [{name: torch.zeros_like(view) for name, view in kv.items()} for kv in caches]
    loaders = []
    for rank, copies in enumerate(ranks):
        copies.close()
        loaders.append(check.engine(geometry, fresh[rank], region, rank))
        load_step(loaders[-1], [GroupCopy(2, 0, slots, into)])
        failed += len(check.settle(loaders[-1]).failed)
    equal = all(equal_pages(caches[rank], on, fresh[rank], into) for rank in range(2))
    scopes = [copies.pins.plan.scope.name if copies.pins else None for copies in loaders]
    for copies in loaders:
        copies.close()
    region.close()
    check.checks["tp2: each rank pins its shares only, both byte-equal"] = (
        equal and not failed and scopes == [PinScope.SHARES.name] * 2)
    return {"share_bytes": geometry.rank_bytes, "slot_bytes": geometry.slot_bytes, "scopes": scopes,
            "all_equal": equal, "failed_jobs": failed}


def hybrid(check: Check, blocks: int) -> dict[str, Any]:
    """Two groups (4 full-attention layers, 2 sliding-window ones of half the page); one job failing in one group."""
    full = check.kv("LBNHC", SMALL, 2 * blocks, prefix="full")
    sliding = check.kv("LBNHC", {**SMALL, "layers": 2, "content": SMALL["content"] // 2}, 2 * blocks,
                       prefix="window")
    kv = {**full, **sliding}
    geometry = SlotGeometry((GroupGeometry(GroupKind.FULL, tuple(full), next(iter(full.values()))[0].numel()),
                             GroupGeometry(GroupKind.SLIDING, tuple(sliding), next(iter(sliding.values()))[0].numel(),
                                           window_blocks=3)), 1, SMALL["tokens"])
    region = check.region(4 * blocks, geometry.slot_bytes)
    region.slots.fill_(0xAB)
    copies = check.engine(geometry, kv, region, kind=Held)
    slots = check.scattered(4 * blocks, 4 * blocks)
    half = blocks // 2
    good = [GroupCopy(1, 0, slots[:half], tuple(range(half))), GroupCopy(1, 1, slots[half:blocks], tuple(range(half)))]
    bad = [GroupCopy(2, 0, slots[blocks : blocks + half], tuple(range(half, blocks))),
           GroupCopy(2, 1, slots[blocks + half : 2 * blocks], (2 * blocks,) * half)]  # group 1: no such block
    store_failed = store_step(copies, [*good, *bad])
    copies.released = True
    stored = check.settle(copies)
    untouched = bool((region.slots[list(slots[blocks : 2 * blocks])] == 0xAB).all())
    fresh = {name: torch.zeros_like(view) for name, view in kv.items()}
    loader = check.engine(geometry, fresh, region, kind=Held)
    load = [GroupCopy(3, 0, good[0].slots, tuple(range(half, blocks))),
            GroupCopy(3, 1, good[1].slots, tuple(range(half, blocks))),
            GroupCopy(4, 0, good[0].slots, tuple(range(blocks, blocks + half))),
            GroupCopy(4, 1, (10**9,) * half, tuple(range(blocks, blocks + half)))]  # group 1: no such slot
    load_failed = load_step(loader, load)
    early = loader.poll()
    loader.released = True
    loaded = check.settle(loader)
    equal = (equal_pages(full, good[0].blocks, fresh, load[0].blocks)
             and equal_pages(sliding, good[1].blocks, fresh, load[1].blocks))
    copies.close()
    loader.close()
    region.close()
    result = {"store_failed_at_once": store_failed, "store_done": stored.done, "store_failed": stored.failed,
              "failed_job_slots_untouched": untouched, "load_failed_at_once": load_failed,
              "reported_while_in_flight": early.done + early.failed, "load_done": loaded.done,
              "load_failed": loaded.failed, "all_equal": equal, "launch_works": check.launch_works()}
    check.checks["hybrid: a job failing in one group, reported once its copies ended"] = (
        store_failed == [2] and stored.done == [1] and stored.failed == [2] and untouched and load_failed == [4]
        and not result["reported_while_in_flight"] and loaded.done == [3] and loaded.failed == [4] and equal
        and result["launch_works"])
    return result


def injected(check: Check) -> dict[str, Any]:
    """A failing copy, a region larger than its directory's room, and (CUDA) a synchronizing call the engine's
    error handling would swallow: each caught."""
    kv = check.kv("LBNHC", SMALL, 16)
    geometry = one_group(kv)
    region = check.region(16, geometry.slot_bytes)
    results: dict[str, Any] = {}
    for kind, job in ((MemcpyKind.DEVICE_TO_HOST, 1), (MemcpyKind.HOST_TO_DEVICE, 2)):
        copies = check.engine(geometry, kv, region, runtime=FailingCopies(check.runtime, kind))
        copy = GroupCopy(job, 0, check.scattered(4, 16), check.scattered(4, 16))
        at_once = store_step(copies, [copy]) if job == 1 else load_step(copies, [copy])
        completed = check.settle(copies)
        copies.close()
        caught = (completed.failed == [job] and not completed.done and check.runtime.last_error() == 0
                  and check.launch_works())
        results[f"failing {kind.name.lower()} copy"] = {"failed_at_once": at_once, "failed": completed.failed,
                                                        "caught": caught}
    free = free_bytes(check.dir)
    path = check.dir / "tiercache-full-dp0"
    try:
        SharedRegion.for_worker(path, free // geometry.slot_bytes + 1, geometry.slot_bytes, 0)
        error = None
    except RegionSpaceError as refused:
        error = str(refused)
    results["region larger than its directory's room"] = {
        "error": error, "caught": error is not None and "capacity_bytes" in error and not path.exists()}
    if check.cuda:
        copies = check.engine(geometry, kv, region, kind=Syncing)
        copy = GroupCopy(3, 0, check.scattered(4, 16), check.scattered(4, 16))
        seen = check.syncs(lambda: store_step(copies, [copy]))
        check.settle(copies)
        torch.cuda.set_sync_debug_mode("error")
        try:
            store_step(copies, [copy])
            error_mode_raised = False
        except RuntimeError:
            error_mode_raised = True
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check.settle(copies)
        copies.close()
        results["synchronizing call inside error handling"] = {
            "seen_as_warnings": seen, "error_mode_raised": error_mode_raised, "caught": bool(seen)}
    region.close()
    for name, result in results.items():
        check.checks[f"injected: {name}"] = result["caught"]
    return results


COLUMNS = (("section", 8), ("layout", 18), ("direction", 9), ("gbps", 8), ("ceiling_gbps", 12), ("ratio", 6),
           ("overlap", 7), ("syncs_per_step", 14), ("jobs_ok", 7))


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row: GB/s, a contiguous pinned copy's, their ratio, overlap and syncs per step."""
    def cell(value: Any, width: int) -> str:
        text = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        return text.rjust(width)
    lines = [" ".join(name.rjust(width) for name, width in COLUMNS)]
    lines += [" ".join(cell(row.get(name), width) for name, width in COLUMNS) for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = arguments(__doc__ or "")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=128, help="blocks in a step's transfer (2 MiB each)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--break", dest="broken", choices=BREAKS,
                        help="turn one guard off on purpose (gpu_connector_breaks): the check must then fail")
    args = parse(parser, blocks=8, repeats=2)
    if args.broken == "2d-runs":
        break_runs()
    out = result_path(__file__, args.out)
    engine_log = logging.FileHandler(out.with_name(f"{out.stem}_engine.log"), mode="w")
    for name in ("vllm", "tiercache"):  # the engine's logs (the injected failures' tracebacks) to a file
        logger = logging.getLogger(name)
        logger.addHandler(engine_log)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    check = Check(torch.device(args.device), broken=args.broken)
    shape = SMALL if args.quick else FULL
    check.checks["a CUDA runtime to call"] = check.runtime is not None
    if check.runtime is None:  # nothing below can pin, inject or clear an error
        shutil.rmtree(check.dir, ignore_errors=True)
        write_result(__file__, {"device": str(check.device), "checks": check.checks, "passed": False}, args.out,
                     args.quick)
        raise SystemExit("FAILED: no CUDA runtime loaded by torch to call (libcudart in /proc/self/maps)")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if check.cuda else "cpu", "shape": shape,
                              "broken": args.broken}
    rows: list[dict[str, Any]] = []
    sections: dict[str, Callable[[], Any]] = {
        "layouts": lambda: layouts(check, max(args.blocks // 8, 4)),
        "rows": lambda: [row for layout in LAYOUTS for row in step_rows(check, layout, shape, args.blocks,
                                                                         args.repeats)],
        "pageable_rows": lambda: step_rows(check, "LBNHC", shape, args.blocks, args.repeats, refused=True),
        "tp2": lambda: tp2(check, max(args.blocks // 4, 2)),
        "hybrid": lambda: hybrid(check, 8),
        "asynchronous": lambda: asynchronous(check, shape, args.blocks, args.repeats, overlap),
        "injected": lambda: injected(check),
        "stream_order": lambda: stream_order(check),
        "big_run": lambda: big_run(check),
        "worker_order": lambda: worker_order(check, shape),
    }
    try:
        for name, run in sections.items():
            try:  # a section that breaks is a failed check with its traceback; the others still run
                result[name] = run()
            except Exception:
                check.checks[f"{name} ran"] = False
                result[name] = {"error": traceback.format_exc()}
                print(result[name]["error"])
        rows = [row for name in ("rows", "pageable_rows") if isinstance(result[name], list) for row in result[name]]
        check.checks["every step's jobs done"] = bool(rows) and all(row["jobs_ok"] for row in rows)
        if check.cuda:
            check.checks["no synchronizing call in a step"] = all(row["syncs_per_step"] == GOAL_SYNCS for row in rows)
        if check.cuda and not args.quick:
            pinned = [row for row in rows if row["pinned"]]
            check.checks[f"pinned steps at >= {GOAL_RATIO}x a contiguous copy"] = bool(pinned) and all(
                (row["ratio"] or 0) >= GOAL_RATIO for row in pinned)
    finally:
        shutil.rmtree(check.dir, ignore_errors=True)
    result.update(goals={"ratio": GOAL_RATIO, "overlap": GOAL_OVERLAP, "syncs_per_step": GOAL_SYNCS},
                  checks=check.checks, passed=all(check.checks.values()))
    path = write_result(__file__, result, args.out, args.quick)
    print(table(rows))
    for name, passed in check.checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    print(f"{'PASSED' if result['passed'] else 'FAILED'}; wrote {path}")
    if not result["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
