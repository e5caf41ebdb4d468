"""docs/embedding.md's scheduler loop, run as written: GPU, CPU and remote prefixes are reused bit for bit, and a
full pool makes it back off (the page's ``scheduler-loop`` example)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.doc_pages import load_topology, run

from tiercache.blocks.paged import PagedKV
from tiercache.config import TierCacheConfig
from tiercache.manager.tier_manager import TierManager
from tiercache.tiers.simulated import SimulatedStore
from tiercache.tools.reference_model import ModelSpec, ReferenceModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE, PREFIX_BLOCKS, SUFFIX, DECODE_STEPS = 4, 5, 3, 4
PREFIX = PREFIX_BLOCKS * BLOCK_SIZE
STEP_PAUSE_S = 0.001
MAX_STEPS = 5000
"""A scheduler step loop gives a pending remote answer up to about five seconds before failing."""
STORE = "docs-scheduler"


class Request:
    """What the documented loop expects of a request: tokens, max_new, and decode(logits)."""

    def __init__(self, mgr: TierManager, model: ReferenceModel, kv: PagedKV, tokens: list[int]) -> None:
        self.mgr, self.model, self.kv = mgr, model, kv
        self.tokens, self.max_new = tokens, DECODE_STEPS
        self.table: list[int] = []
        self.cached = 0
        self.load: Any = None
        self.result: tuple[list[int], list[torch.Tensor]] | None = None

    def decode(self, logits: torch.Tensor) -> None:
        """Greedy decoding from the prefill's logits (as ``ReferenceModel.generate``), then release."""
        outputs, history, position = [], [logits], len(self.tokens)
        for _ in range(self.max_new):
            token = int(logits[-1].argmax())
            outputs.append(token)
            logits = self.model.forward([token], position, self.table, self.kv)
            history.append(logits)
            position += 1
        self.result = (outputs, history)
        self.mgr.release(self.table)


def topology(gpu_blocks: int = 32) -> TierCacheConfig:
    """GPU + CPU + a simulated remote that outlives the manager (by its store's name)."""
    remote = {"name": "remote", "type": "simulated", "options": {"store": STORE, "latency_ms": 1}}
    layout = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "block_size": BLOCK_SIZE}
    tiers = [
        {"name": "gpu", "type": "gpu", "capacity_blocks": gpu_blocks, "options": {"device": "cpu"}},
        {"name": "cpu", "type": "cpu", "capacity_blocks": 64},
        remote,
    ]
    return load_topology({"model": {"id": "docs"}, "layout": layout, "tiers": tiers})


def model_for(mgr: TierManager) -> ReferenceModel:
    return ReferenceModel(ModelSpec.for_layout(mgr.layout, heads_per_kv_head=2, vocab_size=128, seed=3))


def serve(schedule_step: Callable[..., None], mgr: TierManager, prompts: list[list[int]]) -> list[Request]:
    """Run the documented loop until every request has decoded."""
    model, kv = model_for(mgr), PagedKV(mgr.layout, mgr.gpu.tensors)
    requests = [Request(mgr, model, kv, prompt) for prompt in prompts]
    waiting, loading = list(requests), []
    for _ in range(MAX_STEPS):
        if all(r.result is not None for r in requests):
            return requests
        schedule_step(mgr, waiting, loading, model, kv)
        time.sleep(STEP_PAUSE_S)
    raise AssertionError(f"requests not served: {len(waiting)} waiting, {len(loading)} loading")


def recompute(mgr: TierManager, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """A private pool: the prefix in one pass, then the same continuation."""
    model = model_for(mgr)
    kv = PagedKV(mgr.layout, mgr.layout.allocate_pool(16, "cpu"))
    table = list(range(16))
    model.forward(prompt[:PREFIX], 0, table, kv)
    return model.generate(prompt, PREFIX, table, kv, DECODE_STEPS)


def assert_same(expected: tuple[list[int], list[torch.Tensor]], got: tuple[list[int], list[torch.Tensor]]) -> None:
    assert got[0] == expected[0]
    for want, have in zip(expected[1], got[1], strict=True):
        assert torch.equal(want, have)


@pytest.fixture
def schedule_step() -> Iterator[Callable[..., None]]:
    """The documented ``schedule_step``, with the simulated remote's store emptied before and after."""
    SimulatedStore.forget(STORE)
    yield run("scheduler-loop")["schedule_step"]
    SimulatedStore.forget(STORE)


def test_scheduler_loop_reuses_gpu_cpu_and_remote_prefixes_bitwise(schedule_step: Callable[..., None]) -> None:
    prompt = torch.randint(0, 128, (PREFIX + SUFFIX,), generator=torch.Generator().manual_seed(1)).tolist()
    with TierManager(topology()) as first:
        serve(schedule_step, first, [prompt[:PREFIX]])  # computes and stores the prefix
        hit = first.lookup(prompt)
        assert hit.tier_blocks["gpu"] == PREFIX_BLOCKS
        first.release(hit.gpu_block_ids)
        (from_gpu,) = serve(schedule_step, first, [prompt])
        first.release(first.allocate(first.gpu.num_blocks))  # the prefix now lives in the CPU tier
        (from_cpu,) = serve(schedule_step, first, [prompt])
    with TierManager(topology()) as second:  # a fresh engine: only the remote has it
        assert second.lookup_wait(prompt).tier_blocks["remote"] == PREFIX_BLOCKS
        (from_remote,) = serve(schedule_step, second, [prompt])
    expected = recompute(second, prompt)
    for request in (from_gpu, from_cpu, from_remote):
        assert request.cached + request.load.result() == PREFIX
        assert_same(expected, request.result)


def test_scheduler_loop_backs_off_when_the_pool_is_full(schedule_step: Callable[..., None]) -> None:
    prompt = torch.randint(0, 128, (PREFIX + SUFFIX,), generator=torch.Generator().manual_seed(2)).tolist()
    with TierManager(topology(gpu_blocks=PREFIX_BLOCKS + 3)) as mgr:
        serve(schedule_step, mgr, [prompt[:PREFIX]])
        held = mgr.allocate(3)  # another request holds the free blocks: the next one cannot fit
        model, kv = model_for(mgr), PagedKV(mgr.layout, mgr.gpu.tensors)
        waiting, loading = [Request(mgr, model, kv, prompt)], []
        schedule_step(mgr, waiting, loading, model, kv)
        assert waiting and not loading
        mgr.release(held)
        (served,) = serve(schedule_step, mgr, [prompt])
    assert_same(recompute(mgr, prompt), served.result)
