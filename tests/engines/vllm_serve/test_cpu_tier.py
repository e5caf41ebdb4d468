"""The CPU tier alone (no Redis) under a server without vLLM's own prefix cache, and with little KV of its own.

A repeated prompt is served from tiercache's CPU tier. Requests whose KV does
not fit together (in vLLM's blocks, nor in the CPU tier) are preempted; vLLM asks the connector again when it resumes
one, and the blocks it stored (prompt and output so far) load back. Every
answer equals the baseline's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.vllm_serving import (
    BLOCK,
    PREEMPTED_MAX_TOKENS,
    PROMPTS,
    Counted,
    ask,
    ask_together,
    connector_config,
    log_problems,
    reusable,
    serving,
    settled,
)

from tiercache.testing.vllm_server import VllmServer

PREEMPTED = [name for name in PROMPTS if name.startswith("preempted_")]
KV_BLOCKS = 160
"""vLLM's own KV blocks: the preempted prompts' prompts fit together, their answers do not."""
MAX_MODEL_LEN = 3072
CPU_BLOCKS = 96
"""tiercache's CPU tier: room for the repeated prompt, not for the preempted ones' blocks together (it evicts)."""


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], logs: Path, baseline: dict[str, list[int]]) -> Iterator[VllmServer]:
    assert sum(-(-len(PROMPTS[name]) // BLOCK) for name in PREEMPTED) <= KV_BLOCKS
    assert sum(-(-(len(PROMPTS[name]) + PREEMPTED_MAX_TOKENS) // BLOCK) for name in PREEMPTED) > KV_BLOCKS
    args = ("--no-enable-prefix-caching", "--num-gpu-blocks-override", str(KV_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN))
    config = connector_config([{"type": "cpu", "capacity_blocks": CPU_BLOCKS}])
    with serving(model_dirs["seed0"], logs / "cpu-tier.log", kv_transfer_config=config, args=args) as running:
        yield running


def test_repeated_prompt_from_the_cpu_tier(server, baseline):
    loads = []
    for _ in range(2):
        with Counted(server) as seen:
            assert ask(server, "repeated") == baseline["repeated"]
        loads.append((seen.external, seen.local, seen.tiercache("hit_blocks", tier="cpu")))
    whole = reusable(len(PROMPTS["repeated"]))
    assert loads == [(0, 0, 0), (whole, 0, whole // BLOCK)]


def test_preempted_requests_resume_from_the_cpu_tier(server, baseline):
    with Counted(server) as seen:
        answers = ask_together(server, PREEMPTED)
    assert {name: answer.token_ids for name, answer in answers.items()} == {name: baseline[name] for name in PREEMPTED}
    assert seen.delta("vllm:num_preemptions_total") > 0
    # vLLM counts a resumed request's hits apart from external_prefix_cache_hits: tiercache's counters say it
    loaded = seen.tiercache("loaded_blocks")
    assert loaded > 0
    assert seen.tiercache("hit_blocks", tier="cpu") == loaded
    assert seen.tiercache("failed_loads") == 0


def test_server_stayed_clean(server):
    assert server.healthy()
    assert log_problems(server) == []
    assert settled(server).total("vllm:tiercache_failed_loads_total") == 0
