"""What the SGLang backend costs over the tier it drives: batch_set_v1 / batch_get_v1 / batch_exists of N pages.

SGLang 0.5.23's own host KV pool (``MHATokenToKVPoolHost`` over its device pool, on CPU) and the backend
built by SGLang's storage factory, over one local ``redis-server``. For each host layout (``page_first``:
two blocks per page; ``layer_first``: two per layer) and a batch of N pages, each repetition times, in turn:

- ``adapter``: ``batch_set_v1`` / ``batch_get_v1`` / ``batch_exists`` as SGLang calls them (the pool's
  zero-copy metadata, byte views, key mapping, the RemoteStore with its lane, per-page results);
- ``ceiling``: the Redis tier's own ``put`` / ``get_into`` / ``contains`` of the same blocks (the same
  byte views and tiercache keys, prepared untimed), on the store's loop, with no adapter and no lane.

GB/s count page bytes; ``adapter/ceil`` is the median of the per-repetition ratios (1.0: the backend adds
nothing). Run in the SGLang venv: ``.venv-sglang/bin/python benchmarks/sglang_transfers.py [--quick] [--out PATH]``.
It prints a table and writes ``sglang_transfers.json`` (with the load average).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")  # SGLang's import-time warnings on a CPU-only machine

import torch  # noqa: E402
from common import arguments, parse, write_result  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from tiercache.testing.redis_servers import RedisServer  # noqa: E402
from tiercache.testing.sglang_parts import attach, page_keys, scramble  # noqa: E402

PAGE_SIZE = 16
LAYERS = 16
HEADS = 8
HEAD_DIM = 128
"""A page of 16 tokens x 16 layers x 8 KV heads x 128 x bf16, K and V: 1 MiB."""
LAYOUTS = ("page_first", "layer_first")
MAXMEMORY = "2gb"
GIB = float(1 << 30)


def pool_of(layout: str, pages: int) -> Any:
    """SGLang's host pool with room for three batches of ``pages`` pages (random bytes)."""
    tokens = 3 * pages * PAGE_SIZE
    device = MHATokenToKVPool(tokens, PAGE_SIZE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE_SIZE, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS)
    scramble(pool)
    return pool


def timed(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure(server: RedisServer, layout: str, pages: int, repetitions: int) -> dict[str, Any]:
    pool = pool_of(layout, pages)
    topology = {"tiers": [{"name": "redis", "type": "redis", "options": {"url": server.url}}],
                "queues": {"max_pending_stores": 1 << 20}}
    backend = attach(pool, topology)
    keys = page_keys(pages, seed=len(layout))
    source, target = pool.alloc(pages * PAGE_SIZE), pool.alloc(pages * PAGE_SIZE)
    store, tier = backend.store, backend.store.tiers[0]
    blocks = store.keys(backend._block_keys(backend.pages, keys))
    source_views = backend.pages.views(source, pages)
    target_views = backend.pages.views(target, pages)
    page_bytes = backend.pages.pieces * backend.pages.piece_bytes

    def on_loop(coroutine: Any) -> list:
        return store.runtime.submit(coroutine).result()

    def check(ok: bool, name: str) -> None:
        if not ok:
            raise RuntimeError(f"{layout}: {name} failed")

    every = [True] * pages
    operations = {
        "set": (lambda: check(backend.batch_set_v1(keys, source) == every, "batch_set_v1"),
                lambda: check(all(on_loop(tier.put(blocks, source_views))), "put")),
        "get": (lambda: check(backend.batch_get_v1(keys, target) == every, "batch_get_v1"),
                lambda: check(all(on_loop(tier.get_into(blocks, target_views))), "get_into")),
        "exists": (lambda: check(backend.batch_exists(keys) == pages, "batch_exists"),
                   lambda: check(len(on_loop(tier.contains(blocks))) == len(blocks), "contains")),
    }
    backend.batch_set_v1(keys, source)  # the key space exists before anything is timed
    rows: dict[str, Any] = {}
    try:
        for name, (adapter, ceiling) in operations.items():
            pairs = [(timed(adapter), timed(ceiling)) for _ in range(repetitions)]
            adapter_s = statistics.median(a for a, _ in pairs)
            ceiling_s = statistics.median(c for _, c in pairs)
            rows[name] = {
                "adapter_ms": adapter_s * 1e3,
                "ceiling_ms": ceiling_s * 1e3,
                "adapter_gbps": pages * page_bytes / adapter_s / GIB,
                "ceiling_gbps": pages * page_bytes / ceiling_s / GIB,
                "adapter_vs_ceiling": statistics.median(c / a for a, c in pairs),
            }
    finally:
        backend.close()
    return {"layout": layout, "pages": pages, "page_bytes": page_bytes, "blocks_per_page": backend.pages.pieces,
            "operations": rows}


def main() -> None:
    args = parse(arguments(__doc__.splitlines()[0]))
    batches = [4] if args.quick else [16, 128]
    repetitions = 1 if args.quick else 7
    results = []
    with_load = os.getloadavg()
    server = RedisServer(maxmemory=MAXMEMORY).start()
    try:
        for layout in LAYOUTS:
            for pages in batches:
                results.append(measure(server, layout, pages, repetitions))
    finally:
        server.close()
    print(f"{'layout':<12} {'pages':>5} {'op':<7} {'adapter ms':>10} {'ceil ms':>8} {'adapter GB/s':>12} "
          f"{'ceil GB/s':>9} {'adapter/ceil':>12}")
    for result in results:
        for name, row in result["operations"].items():
            print(f"{result['layout']:<12} {result['pages']:>5} {name:<7} {row['adapter_ms']:>10.2f} "
                  f"{row['ceiling_ms']:>8.2f} {row['adapter_gbps']:>12.2f} {row['ceiling_gbps']:>9.2f} "
                  f"{row['adapter_vs_ceiling']:>12.2f}")
    load = {"before": with_load, "after": os.getloadavg()}
    result = {"repetitions": repetitions, "load_average": load, "results": results}
    path = write_result(__file__, result, args.out, args.quick)
    print(f"load average before/after: {load['before'][0]:.2f} / {load['after'][0]:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
