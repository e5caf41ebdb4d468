"""Two tensor-parallel workers (each its own process, its own shard of every KV block): the CPU tier's slot holds
both ranks' pages of a block, a store counts once both copied it, and a load fills both shards.

The same prompt twice on one server without vLLM's own prefix cache: the first
answer is computed, the second is loaded from tiercache's CPU tier, and they
agree (and with the single-worker baseline).
"""

from __future__ import annotations

from pathlib import Path

from support.vllm_serving import (
    BLOCK,
    PROMPTS,
    Counted,
    ask,
    connector_config,
    cpu_tier,
    log_problems,
    reusable,
    serving,
)

TWO_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
"""One core per worker (vLLM's CPU build reserves a core by default)."""


def test_two_workers_store_and_load_their_shards(model_dirs: dict[str, Path], logs: Path,
                                                 baseline: dict[str, list[int]]):
    args = ("--tensor-parallel-size", "2", "--no-enable-prefix-caching")
    config = connector_config([cpu_tier()])
    with serving(model_dirs["seed0"], logs / "tp2.log", kv_transfer_config=config, args=args,
                 env=TWO_WORKERS) as server:
        loads, answers = [], []
        for _ in range(2):
            with Counted(server) as seen:
                answers.append(ask(server, "tp"))
            loads.append((seen.external, seen.tiercache("hit_blocks", tier="cpu")))
        problems = log_problems(server)
    whole = reusable(len(PROMPTS["tp"]))
    assert loads == [(0, 0), (whole, whole // BLOCK)]
    assert answers[1] == answers[0]
    assert answers[0] == baseline["tp"]
    assert problems == []
