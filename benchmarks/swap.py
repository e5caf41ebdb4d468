"""Scattered block swaps (GPU pool <-> pinned CPU slots) next to one contiguous copy of the same bytes.

Cells: 64 and 512 blocks; block-major blocks of 2 MiB, and layer-major blocks of
32 layers x 64 KiB pieces; GPU->CPU and CPU->GPU. The ceiling is one contiguous
pinned copy of the same number of bytes measured in the same run (on a machine
without CUDA the pool lives in host memory and the ceiling is a host memcpy).
Target on an H100: >= 0.9x the contiguous figure in every cell.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

from tiercache.layout import KVLayout, MemoryOrder
from tiercache.swap import TorchSwapper

BLOCK_COUNTS = (64, 512)
REPEATS = 5
LAYOUT = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 16}
TARGET_RATIO = 0.9


def timed(run, synchronize) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    pinned = device == "cuda"
    rows = []
    for memory in MemoryOrder:
        layout = KVLayout(**LAYOUT, memory=memory)
        pool_blocks = max(BLOCK_COUNTS) * 2
        pool = layout.allocate_pool(pool_blocks, device)
        host = torch.empty((max(BLOCK_COUNTS) * 2, layout.bytes_per_block), dtype=torch.uint8, pin_memory=pinned)
        swapper = TorchSwapper(layout, pool, host)
        for count in BLOCK_COUNTS:
            rng = random.Random(count)
            ids = rng.sample(range(pool_blocks), count)
            slots = rng.sample(range(host.shape[0]), count)
            nbytes = count * layout.bytes_per_block
            flat_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat_host = host.view(-1)[:nbytes]
            ceiling_out = timed(lambda fh=flat_host, fd=flat_device: fh.copy_(fd, non_blocking=True), synchronize)
            ceiling_in = timed(lambda fh=flat_host, fd=flat_device: fd.copy_(fh, non_blocking=True), synchronize)
            out = timed(lambda i=ids, s=slots, w=swapper: w.to_host(i, s).wait(), synchronize)
            back = timed(lambda i=ids, s=slots, w=swapper: w.to_device(s, i).wait(), synchronize)
            for direction, seconds, ceiling in (("gpu->cpu", out, ceiling_out), ("cpu->gpu", back, ceiling_in)):
                rows.append(
                    {
                        "memory": memory.value,
                        "blocks": count,
                        "direction": direction,
                        "bytes": nbytes,
                        "gb_per_s": nbytes / seconds / 1e9,
                        "contiguous_gb_per_s": nbytes / ceiling / 1e9,
                        "ratio": ceiling / seconds,
                    }
                )
            del flat_device
    print(f"device: {device}   (ceiling: one contiguous {'pinned copy' if pinned else 'host memcpy'})")
    print(f"{'memory':<12}{'blocks':>7}{'direction':>11}{'GB/s':>8}{'ceiling':>9}{'ratio':>7}{'>=0.9':>7}")
    for row in rows:
        print(
            f"{row['memory']:<12}{row['blocks']:>7}{row['direction']:>11}{row['gb_per_s']:>8.2f}"
            f"{row['contiguous_gb_per_s']:>9.2f}{row['ratio']:>7.2f}"
            f"{'yes' if row['ratio'] >= TARGET_RATIO else 'no':>7}"
        )
    print(f"wrote {write_result(__file__, {'device': device, 'layout': LAYOUT, 'rows': rows})}")


if __name__ == "__main__":
    main()
