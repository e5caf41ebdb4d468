"""Batched GPU<->CPU block copies: exact for both memory orders, any block and slot order, every path.

Each check draws fresh random bytes and poisons the destinations first, so an
unwritten byte or a misplaced piece shows. The CPU tests run everywhere with
``device="cpu"`` standing in for the GPU pool; the CUDA tests run every swap path
(batched DMA, the zero-copy kernel, torch runs, torch gather, and what
``make_swapper`` picks) on a real GPU and are skipped, with the reason shown,
where none is present or where a path cannot be built (no CuPy, old driver).
"""

from __future__ import annotations

import random

import pytest
import torch

from tiercache.blocks.layout import KVLayout, MemoryOrder
from tiercache.movement.swap import (
    PathChoice,
    SwapPath,
    Swapper,
    TorchSwapper,
    build_swapper,
    contiguous_runs,
    make_swapper,
)

POISON = 0x5A
DTYPES = ["float16", "bfloat16", "float8_e4m3fn", "float32"]
HAS_CUDA = torch.cuda.is_available()
CUDA_REASON = "CUDA not available: the GPU swap paths run on a CUDA machine only"
BLOCKS, SLOTS = 41, 45
COUNTS = (1, 7, 19)
"""Odd batch sizes."""
LAYOUTS = {
    "small": dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4),
    "chunked": dict(num_layers=4, num_kv_heads=4, head_dim=128, block_size=16),
    "unaligned": dict(num_layers=2, num_kv_heads=1, head_dim=3, block_size=1),
}
"""``chunked``: blocks of 128-256 KiB, more than one kernel chunk; ``unaligned``: pieces not a multiple of 16 bytes."""
MAKE = "make_swapper"
DMA_LANES = "dma_batch_lanes"
"""Batched DMA split over three streams (an uneven split of every batch)."""
SLEEP_CYCLES = 50_000_000
"""GPU clock cycles the engine stream spins (tens of milliseconds) to expose a missing wait."""
CUDA_PATHS = [*(path.value for path in SwapPath), DMA_LANES, MAKE]


def random_bytes(shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def fill_random(pool: list[torch.Tensor]) -> None:
    for tensor in pool:
        raw = tensor.view(torch.uint8)
        raw.copy_(random_bytes(tuple(raw.shape), str(tensor.device)))


def block_bytes(layout: KVLayout, pool: list[torch.Tensor], block: int) -> bytes:
    """A block's serialized bytes computed independently of the swappers."""
    if layout.block_major:
        return pool[0][block].cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return b"".join(t[block].cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in pool)


def layer_bytes(pool: list[torch.Tensor], layer: int, block: int) -> bytes:
    return pool[layer][block].cpu().contiguous().view(torch.uint8).numpy().tobytes()


def make(path: str, layout: KVLayout, pool: list[torch.Tensor], host: torch.Tensor) -> Swapper:
    """The swapper under test, or a visible skip where this path cannot be built here."""
    if path == MAKE:
        return make_swapper(layout, pool, host)
    choice = PathChoice(SwapPath.DMA_BATCH, lanes=3) if path == DMA_LANES else None
    try:
        return build_swapper(choice or SwapPath(path), layout, pool, host)
    except (ImportError, OSError, RuntimeError) as error:
        pytest.skip(f"swap path {path} unavailable here: {error}")


def setup(layout: KVLayout, device: str, path: str) -> tuple[list[torch.Tensor], torch.Tensor, Swapper]:
    pool = layout.allocate_pool(BLOCKS, device)
    fill_random(pool)
    host = torch.full((SLOTS, layout.bytes_per_block), POISON, dtype=torch.uint8, pin_memory=device != "cpu")
    return pool, host, make(path, layout, pool, host)


def poison_pool(pool: list[torch.Tensor], blocks: list[int]) -> None:
    for tensor in pool:
        tensor.view(torch.uint8)[blocks] = POISON


def check_roundtrip(layout: KVLayout, device: str, path: str, seed: int) -> None:
    rng = random.Random(seed)
    pool, host, swapper = setup(layout, device, path)
    for count in COUNTS:
        fill_random(pool)
        host.fill_(POISON)
        sources = [rng.randrange(BLOCKS) for _ in range(count)]  # repeats allowed, unsorted
        cpu_slots = rng.sample(range(SLOTS), count)
        expected_out = {s: block_bytes(layout, pool, b) for b, s in zip(sources, cpu_slots, strict=True)}
        swapper.to_host(sources, cpu_slots).wait()
        for slot, data in expected_out.items():
            assert host[slot].numpy().tobytes() == data, f"slot {slot} wrong ({path}, {count} blocks)"
        untouched = set(range(SLOTS)) - set(cpu_slots)
        assert all(bool((host[s] == POISON).all()) for s in untouched), "a copy wrote outside its slots"

        host.copy_(random_bytes(tuple(host.shape), "cpu"))
        targets = rng.sample(range(BLOCKS), count)
        load_slots = [rng.randrange(SLOTS) for _ in range(count)]  # repeats allowed, unsorted
        poison_pool(pool, targets)
        others = {b: block_bytes(layout, pool, b) for b in range(BLOCKS) if b not in targets}
        swapper.to_device(load_slots, targets).wait()
        for target, slot in zip(targets, load_slots, strict=True):
            assert block_bytes(layout, pool, target) == host[slot].numpy().tobytes(), f"block {target} wrong"
        for block, data in others.items():
            assert block_bytes(layout, pool, block) == data, "a load wrote outside its blocks"


@pytest.mark.parametrize("memory", list(MemoryOrder))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_swap_roundtrip_cpu(memory: MemoryOrder, dtype: str, seed: int) -> None:
    check_roundtrip(KVLayout(**LAYOUTS["small"], dtype=dtype, memory=memory), "cpu", "torch_gather", seed)


def test_make_swapper_on_cpu_pool_is_the_torch_path() -> None:
    layout = KVLayout(**LAYOUTS["small"])
    pool = layout.allocate_pool(4, "cpu")
    assert isinstance(
        make_swapper(layout, pool, torch.empty((4, layout.bytes_per_block), dtype=torch.uint8)), TorchSwapper
    )


def test_repeated_destination_is_refused() -> None:
    layout = KVLayout(**LAYOUTS["small"])
    _, _, swapper = setup(layout, "cpu", "torch_gather")
    with pytest.raises(ValueError, match="twice"):
        swapper.to_device([0, 1], [3, 3])
    with pytest.raises(ValueError, match="sources"):
        swapper.to_host([0, 1], [3])


cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_REASON)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("memory", list(MemoryOrder))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_swap_roundtrip_cuda(path: str, memory: MemoryOrder, dtype: str, shape: str) -> None:
    check_roundtrip(KVLayout(**LAYOUTS[shape], dtype=dtype, memory=memory), "cuda", path, seed=len(path) + len(shape))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("memory", list(MemoryOrder))
def test_both_directions_at_once(path: str, memory: MemoryOrder) -> None:
    """A demotion and a load in flight together on their two streams; both land exactly."""
    layout = KVLayout(**LAYOUTS["chunked"], dtype="bfloat16", memory=memory)
    pool, host, swapper = setup(layout, "cuda", path)
    rng = random.Random(7)
    blocks = rng.sample(range(BLOCKS), 2 * 13)
    slots = rng.sample(range(SLOTS), 2 * 13)
    out_blocks, in_blocks = blocks[:13], blocks[13:]
    out_slots, in_slots = slots[:13], slots[13:]
    host[in_slots] = random_bytes((13, layout.bytes_per_block), "cpu")
    expected_in = [host[s].numpy().tobytes() for s in in_slots]
    expected_out = [block_bytes(layout, pool, b) for b in out_blocks]
    poison_pool(pool, in_blocks)
    outgoing = swapper.to_host(out_blocks, out_slots)
    incoming = swapper.to_device(in_slots, in_blocks)
    incoming.wait()
    outgoing.wait()
    assert outgoing.done() and incoming.done()
    assert [host[s].numpy().tobytes() for s in out_slots] == expected_out
    assert [block_bytes(layout, pool, b) for b in in_blocks] == expected_in


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
def test_layer_events_of_a_layer_major_load(path: str) -> None:
    """Once ``layer_events[i]`` fired, layer ``i`` of every loaded block is in place."""
    layout = KVLayout(**LAYOUTS["chunked"], dtype="float16", memory=MemoryOrder.LAYER_MAJOR)
    pool, host, swapper = setup(layout, "cuda", path)
    host.copy_(random_bytes(tuple(host.shape), "cpu"))
    targets, slots = [5, 2, 30, 11], [40, 3, 17, 9]
    poison_pool(pool, targets)
    handle = swapper.to_device(slots, targets)
    assert handle.layer_events is not None and len(handle.layer_events) == layout.num_layers
    piece = layout.layer_piece_bytes
    for layer, event in enumerate(handle.layer_events):
        event.synchronize()
        for block, slot in zip(targets, slots, strict=True):
            assert layer_bytes(pool, layer, block) == host[slot, layer * piece : (layer + 1) * piece].numpy().tobytes()
    assert handle.layer_events[-1] is handle.event or handle.event.query()
    handle.wait()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
def test_block_major_and_demotions_have_no_layer_events(path: str) -> None:
    layout = KVLayout(**LAYOUTS["small"], dtype="float16")
    _, _, swapper = setup(layout, "cuda", path)
    handle = swapper.to_device([1, 2], [3, 4])
    assert handle.layer_events is None and isinstance(handle.event, torch.cuda.Event)
    handle.wait()
    assert swapper.to_host([3], [0]).layer_events is None


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("memory", list(MemoryOrder))
def test_stream_ordering_with_the_engine(path: str, memory: MemoryOrder) -> None:
    """The copy sees the engine's last write to a block; the engine's next write waits for the copy."""
    layout = KVLayout(**LAYOUTS["chunked"], dtype="bfloat16", memory=memory)
    pool, host, swapper = setup(layout, "cuda", path)
    engine = torch.cuda.Stream()
    block, slot = 9, 21
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)  # an unordered copy would read the random bytes still there
        for tensor in pool:
            tensor.view(torch.uint8)[block] = 0
        handle = swapper.to_host([block], [slot])  # ordered after the zeroing: must see zeros
        engine.wait_event(handle.event)
        for tensor in pool:
            tensor.view(torch.uint8)[block] = 1  # reuse of the demoted block, after the copy
    handle.wait()
    engine.synchronize()
    assert bool((host[slot] == 0).all()), "the copy did not wait for the engine's write, or read the reuse"


def test_contiguous_runs() -> None:
    assert contiguous_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert contiguous_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]
    assert contiguous_runs([]) == []
