"""Scattered block swaps (GPU pool <-> pinned CPU slots) next to one contiguous copy of the same bytes.

Cells: 64 and 512 blocks; block-major blocks of 2 MiB, and layer-major blocks of
32 layers x 64 KiB pieces; GPU->CPU, CPU->GPU and both at once (a demotion and a
load of the same size in flight together). The ceiling is one contiguous pinned
copy of the same bytes measured in the same run (both at once: two contiguous
copies, one per direction, on two streams). Every swap path that can be built
here is timed, and what ``make_swapper`` picks is reported as ``auto``.

Engine-visible cost (CUDA): the step time of a busy stream (bf16 matmuls) while a
512-block demotion and a 512-block load are in flight, against the same step
alone. Targets on an H100: every cell >= 0.9x its contiguous figure, and <= 3%
added to the busy step. On a machine without CUDA the pool lives in host memory,
only the torch path runs and the ceiling is a host memcpy.

Usage: ``python benchmarks/swap.py [--out PATH] [--paths dma_batch,kernel,...] [--no-engine] [--quick]``; ``--out``
a folder (``swap.json``, or ``swap_cuda.json`` with CUDA, goes in it) or a file.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
from common import arguments, machine, parse, result_path, write_result

from tiercache.blocks.layout import KVLayout, MemoryOrder
from tiercache.movement.swap import PathChoice, SwapPath, Swapper, TorchSwapper, build_swapper, make_swapper

BLOCK_COUNTS = (64, 512)
REPEATS = 7
LAYOUT = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 16}
TARGET_RATIO = 0.9
TARGET_STEP_OVERHEAD = 0.03
MATMUL_SIZE = 8192
STEP_MATMULS = 16
"""A busy step: 16 bf16 8192^3 matmuls, about 20 ms on an H100, as long as a 512-block swap."""
ENGINE_STEPS = 15
AUTO = "auto"
DIRECTIONS = ("gpu->cpu", "cpu->gpu", "both")
QUICK = {"BLOCK_COUNTS": (4,), "REPEATS": 1, "MATMUL_SIZE": 1024, "ENGINE_STEPS": 2}
"""The constants ``--quick`` replaces."""


def median_seconds(run: Callable[[], None], synchronize: Callable[[], None]) -> float:
    """Median wall time of ``run`` (after one warm-up), synchronized before and after."""
    samples = []
    for attempt in range(REPEATS + 1):
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        if attempt:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def driver_version() -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip() or None


def software() -> dict[str, Any]:
    info: dict[str, Any] = {"driver": driver_version()}
    for name in ("cupy", "cuda.bindings", "triton"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", "?")
        except ImportError:
            info[name] = None
    return info


class Cells:
    """The blocks and slots of one cell: a demotion set and a disjoint load set."""

    def __init__(self, count: int, pool_blocks: int, slots: int) -> None:
        rng = random.Random(count)
        blocks = rng.sample(range(pool_blocks), 2 * count)
        chosen = rng.sample(range(slots), 2 * count)
        self.out_blocks, self.in_blocks = blocks[:count], blocks[count:]
        self.out_slots, self.in_slots = chosen[:count], chosen[count:]

    def out(self, swapper: Swapper) -> None:
        swapper.to_host(self.out_blocks, self.out_slots).wait()

    def back(self, swapper: Swapper) -> None:
        swapper.to_device(self.in_slots, self.in_blocks).wait()

    def both(self, swapper: Swapper) -> None:
        outgoing = swapper.to_host(self.out_blocks, self.out_slots)
        incoming = swapper.to_device(self.in_slots, self.in_blocks)
        outgoing.wait()
        incoming.wait()


def contiguous(nbytes: int, host: torch.Tensor, device: str, synchronize: Callable[[], None]) -> dict[str, float]:
    """Seconds of one contiguous copy of ``nbytes`` each way, and of one each way at once."""
    flat = host.view(-1)
    host_out, host_in = flat[:nbytes], flat[nbytes : 2 * nbytes]
    device_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    device_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {
        "gpu->cpu": median_seconds(lambda: host_out.copy_(device_out, non_blocking=True), synchronize),
        "cpu->gpu": median_seconds(lambda: device_in.copy_(host_in, non_blocking=True), synchronize),
    }
    if device == "cuda":
        streams = (torch.cuda.Stream(), torch.cuda.Stream())

        def both() -> None:
            with torch.cuda.stream(streams[0]):
                host_out.copy_(device_out, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                device_in.copy_(host_in, non_blocking=True)

        result["both"] = median_seconds(both, synchronize)
    return result


def build_named(name: str, layout: KVLayout, pool: list[torch.Tensor], host: torch.Tensor) -> Swapper:
    """``auto`` (make_swapper), or a ``SwapPath`` value with settings: ``kernel:GRID``,
    ``dma_batch[:plain][:xLANES]`` (plain: without the overlap-with-compute hint)."""
    if name == AUTO:
        return make_swapper(layout, pool, host)
    path, *settings = name.split(":")
    lanes = next((int(item[1:]) for item in settings if item.startswith("x")), 1)
    grid = next((int(item) for item in settings if item.isdigit()), None)
    choice = PathChoice(SwapPath(path), lanes=lanes, prefer_overlap="plain" not in settings, grid=grid)
    return build_swapper(choice, layout, pool, host)


def swappers(layout: KVLayout, pool: list[torch.Tensor], host: torch.Tensor, paths: list[str]) -> dict[str, Any]:
    """Every requested path that builds here (an error string for those that do not)."""
    built: dict[str, Any] = {}
    if pool[0].device.type != "cuda":
        return {SwapPath.TORCH_GATHER.value: TorchSwapper(layout, pool, host)}
    for name in paths:
        try:
            built[name] = build_named(name, layout, pool, host)
        except (ImportError, OSError, RuntimeError) as error:
            built[name] = f"unavailable: {error}"
    return built


def path_name(swapper: Any) -> str:
    """The path(s) a swapper runs: ``out+back`` for a split one."""
    if hasattr(swapper, "paths"):
        return "+".join(swapper.paths)
    return getattr(swapper, "name", type(swapper).__name__)


def busy_step(engine_inputs: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Milliseconds of one busy step on the current stream, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a, b = engine_inputs
    start.record()
    for _ in range(STEP_MATMULS):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def engine_cost(swapper: Swapper, cells: Cells, engine_inputs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Median busy-step time alone and with a demotion and a load in flight."""
    alone, loaded = [], []
    busy_step(engine_inputs)
    for _ in range(ENGINE_STEPS):
        torch.cuda.synchronize()
        alone.append(busy_step(engine_inputs))
        torch.cuda.synchronize()
        outgoing = swapper.to_host(cells.out_blocks, cells.out_slots)
        incoming = swapper.to_device(cells.in_slots, cells.in_blocks)
        loaded.append(busy_step(engine_inputs))
        outgoing.wait()
        incoming.wait()
    step, with_swaps = statistics.median(alone), statistics.median(loaded)
    return {"step_ms": step, "step_with_swaps_ms": with_swaps, "overhead": with_swaps / step - 1}


def run_layout(memory: MemoryOrder, device: str, paths: list[str], engine_inputs: Any) -> tuple[list, list]:
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    layout = KVLayout(**LAYOUT, memory=memory)
    pool_blocks = slots = 2 * max(BLOCK_COUNTS)
    pool = layout.allocate_pool(pool_blocks, device)
    for tensor in pool:
        tensor.view(torch.uint8).random_(0, 256)
    host = torch.empty((slots, layout.bytes_per_block), dtype=torch.uint8, pin_memory=device == "cuda")
    host.random_(0, 256)
    built = swappers(layout, pool, host, paths)
    rows, engine_rows = [], []
    for count in BLOCK_COUNTS:
        nbytes = count * layout.bytes_per_block
        ceiling = contiguous(nbytes, host, device, synchronize)
        cells = Cells(count, pool_blocks, slots)
        for name, swapper in built.items():
            if isinstance(swapper, str):
                rows.append({"memory": memory.value, "blocks": count, "path": name, "error": swapper})
                continue
            runs = {"gpu->cpu": cells.out, "cpu->gpu": cells.back, "both": cells.both}
            for direction in DIRECTIONS:
                if direction not in ceiling:
                    continue
                try:
                    seconds = median_seconds(lambda run=runs[direction], s=swapper: run(s), synchronize)
                except Exception as error:  # one broken path must not cost the other paths' figures
                    rows.append({"memory": memory.value, "blocks": count, "path": name, "error": repr(error)})
                    continue
                moved = nbytes * (2 if direction == "both" else 1)
                rows.append(
                    {
                        "memory": memory.value,
                        "blocks": count,
                        "path": path_name(swapper),
                        "requested": name,
                        "direction": direction,
                        "bytes": moved,
                        "gb_per_s": moved / seconds / 1e9,
                        "contiguous_gb_per_s": moved / ceiling[direction] / 1e9,
                        "ratio": ceiling[direction] / seconds,
                    }
                )
            if engine_inputs is not None and count == max(BLOCK_COUNTS):
                cost = engine_cost(swapper, cells, engine_inputs)
                engine_rows.append({"memory": memory.value, "blocks": count, "path": name, **cost})
                print(f"  engine {memory.value} {name}: {cost}", flush=True)
    del pool, host
    return rows, engine_rows


def print_table(device: str, rows: list[dict[str, Any]], engine_rows: list[dict[str, Any]]) -> None:
    print(f"device: {device}   (ceiling: contiguous {'pinned copies' if device == 'cuda' else 'host memcpy'})")
    print(f"{'memory':<12}{'blocks':>7}{'path':>26}{'direction':>10}{'GB/s':>8}{'ceiling':>9}{'ratio':>7}{'>=0.9':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['memory']:<12}{row['blocks']:>7}{row['path']:>26}  {row['error']}")
            continue
        print(
            f"{row['memory']:<12}{row['blocks']:>7}{row['requested']:>26}{row['direction']:>10}{row['gb_per_s']:>8.2f}"
            f"{row['contiguous_gb_per_s']:>9.2f}{row['ratio']:>7.2f}"
            f"{'yes' if row['ratio'] >= TARGET_RATIO else 'no':>7}"
        )
    if engine_rows:
        print(f"busy step ({STEP_MATMULS} bf16 {MATMUL_SIZE}^3 matmuls) with a demotion and a load in flight:")
        print(f"{'memory':<12}{'path':>26}{'step ms':>9}{'w/ swaps':>10}{'added':>8}{'<=3%':>6}")
        for row in engine_rows:
            print(
                f"{row['memory']:<12}{row['path']:>26}{row['step_ms']:>9.2f}{row['step_with_swaps_ms']:>10.2f}"
                f"{row['overhead'] * 100:>7.1f}%{'yes' if row['overhead'] <= TARGET_STEP_OVERHEAD else 'no':>6}"
            )


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join([*(p.value for p in SwapPath), AUTO]))
    parser.add_argument("--no-engine", action="store_true", help="skip the busy-step measurement")
    args = parse(parser)
    if args.quick:
        globals().update(QUICK)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    paths = args.paths.split(",")
    engine_inputs = None
    if device == "cuda" and not args.no_engine:
        engine_inputs = tuple(torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16) for _ in "ab")
    rows, engine_rows = [], []
    for memory in MemoryOrder:
        layout_rows, layout_engine = run_layout(memory, device, paths, engine_inputs)
        rows += layout_rows
        engine_rows += layout_engine
    print_table(device, rows, engine_rows)
    result = {"device": device, "layout": LAYOUT, "rows": rows, "engine": engine_rows}
    if device != "cuda":
        print(f"wrote {write_result(__file__, result, args.out, args.quick)}")
        return
    path = result_path(__file__, args.out, "swap_cuda.json")
    document = {"machine": {**machine(), **software()}, "quick": args.quick, **result}
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
