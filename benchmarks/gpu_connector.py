"""The vLLM connector's GPU transfer engine, torch only (no vLLM): every KV layout, bandwidth, overlap, syncs.

Run by ``scripts/gpu_check_connector.sh`` on a CUDA machine (one H100 or H200,
under 8 minutes); ``--device cpu --quick`` runs the correctness part here.
KV caches are built as vLLM 0.33 builds them (one allocation, the logical
``[L, B, H, N, C]`` shape and a stride permutation per ``KVCacheLayout``, as
``compute_layout_strides`` in ``vllm/v1/kv_cache_interface.py``; an 8B model's
shape: 32 layers, 8 KV heads, 16 tokens, bf16 head 128, so a block's pages of
every layer are 2 MiB), and moved by the connector's own ``StagedTransfers``
against a region registered as pinned memory:

- ``layouts``: every page byte-equal after a store from each layout and a load
  into each other one (vLLM's logical order in the slots);
- ``bandwidth``: a step's batched store (D2H) and load (H2D) of ``--blocks``
  blocks, GB/s against one contiguous pinned copy of the same bytes in the same
  run (goal: at least 0.9x);
- ``overlap``: a matmul on the compute stream timed alone and while a step's
  store copies run (goal: within 10%);
- ``syncs``: a step's calls under ``torch.cuda.set_sync_debug_mode("error")``,
  which raises on any synchronizing call (goal: 0).

Writes ``gpu_connector.json`` (to ``--out``; the check script puts it under
``$OUT``). Figures come only from a GPU run; none are committed without one.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from common import arguments, parse, write_result

from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.pages import KVPages, page_views
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.transfers import GroupCopy

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
"""vLLM 0.33's ``KVCacheLayout``: the physical order of the logical [L, B, H, N, C] axes."""
GOAL_BANDWIDTH, GOAL_OVERLAP, GOAL_SYNCS = 0.9, 1.1, 0


def kv_cache(layout: str, layers: int, blocks: int, heads: int, tokens: int, content: int,
             device: torch.device) -> dict[str, torch.Tensor]:
    """One allocation viewed per layer as ``[B, H, N, C]`` bytes in ``layout``'s physical order (vLLM's code)."""
    shape = (layers, blocks, heads, tokens, content)
    strides = [0] * 5
    step = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.empty(step, dtype=torch.uint8, device=device)
    view = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{index}.self_attn.attn": view[index] for index in range(layers)}


def engine(kv: dict[str, torch.Tensor], region: torch.Tensor, page: int) -> tuple[StagedTransfers, SlotGeometry]:
    geometry = SlotGeometry((GroupGeometry(GroupKind.FULL, tuple(kv), page),), 1, next(iter(kv.values())).shape[2])
    pages = KVPages(page_views(kv, geometry), geometry, 0, region)
    return StagedTransfers(pages, geometry, 0, region), geometry


def one_step_store(copies: StagedTransfers, job: GroupCopy) -> None:
    for layer in range(len(copies.pages.layers)):
        copies.store_layer(layer, [job])
    copies.end_step([], [job.job_id])


def wait_all(copies: StagedTransfers, device: torch.device) -> list[int]:
    done = copies.drain().done
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return done


def check_layouts(shape: dict[str, int], blocks: int, device: torch.device) -> dict[str, Any]:
    """Store from each layout, load into each other; every page compared in vLLM's logical order."""
    page = shape["heads"] * shape["tokens"] * shape["content"]
    region = torch.zeros((blocks, shape["layers"] * page), dtype=torch.uint8)
    stored_blocks = list(range(1, 2 * blocks, 2))[:blocks]
    loaded_blocks = list(range(blocks))
    results: dict[str, Any] = {}
    for source in LAYOUTS:
        kv = kv_cache(source, blocks=2 * blocks, device=device, **shape)
        for view in kv.values():
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, device=device))
        copies, _ = engine(kv, region, page)
        one_step_store(copies, GroupCopy(1, 0, tuple(range(blocks)), tuple(stored_blocks)))
        wait_all(copies, device)
        for target in LAYOUTS:
            other = kv_cache(target, blocks=2 * blocks, device=device, **shape)
            for view in other.values():
                view.zero_()
            loader, _ = engine(other, region, page)
            loader.load([GroupCopy(2, 0, tuple(range(blocks)), tuple(loaded_blocks))])
            loader.end_step([2], [])
            wait_all(loader, device)
            equal = all(torch.equal(other[name][loaded_blocks], kv[name][stored_blocks]) for name in kv)
            results[f"{source}->{target}"] = equal
    return {"pairs": len(results), "all_equal": all(results.values()), "unequal": [k for k, v in results.items()
                                                                                  if not v]}


def timed(run: Any, repeats: int) -> float:
    """Median milliseconds of ``run`` between CUDA events on the current stream (after a warm-up)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bandwidth(shape: dict[str, int], blocks: int, repeats: int) -> dict[str, Any]:
    """A step's store and load of ``blocks`` blocks (LBNHC, flash-attention's) against one contiguous pinned copy."""
    device = torch.device("cuda")
    page = shape["heads"] * shape["tokens"] * shape["content"]
    slot = shape["layers"] * page
    region = torch.empty((blocks, slot), dtype=torch.uint8)  # pageable until the engine registers it
    kv = kv_cache("LBNHC", blocks=2 * blocks, device=device, **shape)
    copies, _ = engine(kv, region, page)
    job_blocks = tuple(range(0, 2 * blocks, 2))

    def store() -> None:
        one_step_store(copies, GroupCopy(1, 0, tuple(range(blocks)), job_blocks))
        wait_all(copies, device)

    def load() -> None:
        copies.load([GroupCopy(2, 0, tuple(range(blocks)), job_blocks)])
        copies.end_step([2], [])
        wait_all(copies, device)

    nbytes = blocks * slot
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ceiling_d2h = timed(lambda: pinned.copy_(device_bytes, non_blocking=True), repeats)
    ceiling_h2d = timed(lambda: device_bytes.copy_(pinned, non_blocking=True), repeats)
    store_ms, load_ms = timed(store, repeats), timed(load, repeats)
    gbps = lambda ms: nbytes / ms / 1e6  # noqa: E731
    return {
        "bytes": nbytes, "slot_bytes": slot, "pinned_region": copies.pinned,
        "store_gbps": gbps(store_ms), "ceiling_d2h_gbps": gbps(ceiling_d2h), "store_ratio": ceiling_d2h / store_ms,
        "load_gbps": gbps(load_ms), "ceiling_h2d_gbps": gbps(ceiling_h2d), "load_ratio": ceiling_h2d / load_ms,
        "goal": GOAL_BANDWIDTH,
    }


def overlap(shape: dict[str, int], blocks: int, repeats: int) -> dict[str, Any]:
    """A matmul on the compute stream alone, then with a step's store copies in flight on the side stream."""
    device = torch.device("cuda")
    page = shape["heads"] * shape["tokens"] * shape["content"]
    region = torch.empty((blocks, shape["layers"] * page), dtype=torch.uint8)
    kv = kv_cache("LBNHC", blocks=2 * blocks, device=device, **shape)
    copies, _ = engine(kv, region, page)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    alone = timed(lambda: a @ b, repeats)
    job = GroupCopy(1, 0, tuple(range(blocks)), tuple(range(blocks)))

    def with_copies() -> None:
        one_step_store(copies, job)  # gathers queued, then the side stream's D2H
        a @ b
    with_store = timed(with_copies, repeats)
    gather_only = timed(lambda: one_step_store(copies, job), repeats)  # the compute stream's share of a store
    wait_all(copies, device)
    return {"matmul_ms": alone, "matmul_with_store_ms": with_store - gather_only, "gathers_ms": gather_only,
            "ratio": (with_store - gather_only) / alone, "goal": GOAL_OVERLAP}


def syncs(shape: dict[str, int], blocks: int) -> dict[str, Any]:
    """A step's calls with synchronizing CUDA calls turned into errors: how many raised."""
    device = torch.device("cuda")
    page = shape["heads"] * shape["tokens"] * shape["content"]
    region = torch.empty((blocks, shape["layers"] * page), dtype=torch.uint8)
    kv = kv_cache("LBNHC", blocks=2 * blocks, device=device, **shape)
    copies, _ = engine(kv, region, page)
    job = GroupCopy(1, 0, tuple(range(blocks)), tuple(range(blocks)))
    wait_all(copies, device)
    found, where = 0, []
    for name, call in (("load", lambda: copies.load([GroupCopy(2, 0, job.slots, job.blocks)])),
                       ("store", lambda: one_step_store(copies, job)), ("poll", copies.poll)):
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as error:
            found += 1
            where.append(f"{name}: {error}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    wait_all(copies, device)
    return {"synchronizations": found, "where": where, "goal": GOAL_SYNCS}


def main() -> None:
    parser = arguments(__doc__ or "")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=128, help="blocks in a step's transfer (2 MiB each)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parse(parser, blocks=4, repeats=2)
    device = torch.device(args.device)
    full = {"layers": 32, "heads": 8, "tokens": 16, "content": 2 * 128 * 2}
    small = {"layers": 4, "heads": 4, "tokens": 16, "content": 64}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "shape": full, "layouts": check_layouts(small, max(args.blocks // 8, 4), device)}
    if device.type == "cuda":
        result["bandwidth"] = bandwidth(full, args.blocks, args.repeats)
        result["overlap"] = overlap(full, args.blocks, args.repeats)
        result["syncs"] = syncs(full, args.blocks)
    path = write_result(__file__, result, args.out, args.quick)
    print(f"layouts: {result['layouts']['pairs']} pairs, all equal: {result['layouts']['all_equal']}")
    for name in ("bandwidth", "overlap", "syncs"):
        if name in result:
            print(name, {k: v for k, v in result[name].items() if k != "where"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
