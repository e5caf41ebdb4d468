"""Hybrid models under vLLM 0.33's own scheduler with its hybrid allocator on: sliding windows, several KV-cache
groups, Mamba state.

The KV cache configs are vLLM's own (``support.vllm_groups``: its planner over
per-layer specs, ``S`` a sliding window of 48 tokens, ``F`` full attention,
``M`` Mamba). The "model" checks, at every layer's read, the pages its attention
reads: every block before the step's first token for a full layer, the window's
blocks for a sliding one (a null block there is wrong too).
"""

from __future__ import annotations

import pytest
from support.vllm_connector import Instance, Instances, remote_written, request, totals
from support.vllm_groups import WINDOW_BLOCKS, kv_config_of
from support.vllm_parts import BLOCK, cpu_topology, simulated_remote
from vllm.v1.request import RequestStatus

from tiercache.integrations.vllm.connector.groups import ANCHOR_WINDOWS, NULL_BLOCK

GEMMA3 = "SSSF"
"""Gemma 3's pattern: three sliding-window layers to one full (four KV-cache groups of one layer)."""
SPACING = ANCHOR_WINDOWS * WINDOW_BLOCKS
"""Blocks between anchor ends (12)."""
LONG = list(range(2000, 2400))
"""400 tokens: 25 full blocks, over two chunked-prefill steps."""
PAGE = BLOCK * 2 * 8 * 4
"""Bytes of one layer's page (``support.vllm_connector.PAGE_SHAPE``, float32)."""


def pair(vllm: Instances, pattern: str) -> tuple[Instance, Instance, str]:
    """Two instances of a ``pattern`` model over one simulated store; the second starts empty."""
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(blocks=200, remotes=[remote]), kv_config=kv_config_of(pattern))
    second = vllm.new("second", cpu_topology(blocks=200, remotes=[remote]), kv_config=kv_config_of(pattern))
    return first, second, "sim"


def copied_blocks(records: list) -> list[int]:
    """Every vLLM block id a step's load or store job named."""
    jobs = [job for record in records for job in (*record.output.kv_connector_metadata.loads,
                                                  *record.output.kv_connector_metadata.stores)]
    return [block for job in jobs for block in job.block_ids]


def null_pages_untouched(instance: Instance) -> bool:
    """Whether the null block's page still holds the marker in every layer (never copied into)."""
    return all(bool((instance.kv[name][NULL_BLOCK] == -1.0).all()) for name in instance.layers)


def test_vllm_keeps_its_hybrid_allocator_on_with_the_connector(vllm: Instances) -> None:
    first = vllm.new("hma", cpu_topology(), kv_config=kv_config_of(GEMMA3))
    groups = first.kv_cache_config.kv_cache_groups
    assert [type(group.kv_cache_spec).__name__ for group in groups] == ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]
    assert not first.config.scheduler_config.disable_hybrid_kv_cache_manager


@pytest.mark.parametrize("pattern", [GEMMA3, "SF", "FS"])
def test_a_sliding_window_model_stores_its_windows_and_a_restart_loads_them_exactly(
    vllm: Instances, pattern: str
) -> None:
    first, second, name = pair(vllm, pattern)
    full_layers, sliding_layers = pattern.count("F"), pattern.count("S")
    saved = first.serve(request("a", LONG))
    counts = totals(saved)
    full, prompt_blocks = 25, 25
    tail = set(range(prompt_blocks - WINDOW_BLOCKS - 1, prompt_blocks))
    anchors = {p for p in range(full) if p % SPACING >= SPACING - WINDOW_BLOCKS}
    stored = full * full_layers + len(tail | anchors) * sliding_layers
    assert counts["stored_blocks"] == stored, "full layer: every block; sliding: windows only"
    assert counts["stored_bytes"] == stored * PAGE < len(pattern) * full * PAGE
    remote_written(first, name, stored)
    records = second.serve(request("b", LONG))
    usable = (len(LONG) - 1) // BLOCK
    assert sum(record.external_hits for record in records) == usable * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]
    assert not any(record.invalid_blocks for record in records)
    loaded = totals(records)["loaded_blocks"]
    assert loaded == usable * full_layers + WINDOW_BLOCKS * sliding_layers, "full blocks and each window"
    assert NULL_BLOCK not in copied_blocks(saved + records)
    assert null_pages_untouched(first) and null_pages_untouched(second)


def test_a_chat_turn_that_continues_the_answer_reuses_all_of_it(vllm: Instances) -> None:
    first, second, name = pair(vllm, GEMMA3)
    turn = request("turn1", LONG[:200], max_tokens=40)
    saved = first.serve(turn)
    computed = len(turn.all_token_ids) - 1  # the last sampled token has no KV yet
    remote_written(first, name, totals(saved)["stored_blocks"])
    records = second.serve(request("turn2", [*turn.all_token_ids, *range(3000, 3030)]))
    assert sum(record.external_hits for record in records) == computed // BLOCK * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_a_prompt_sharing_only_a_prefix_hits_at_the_last_anchor_inside_it(vllm: Instances) -> None:
    first, second, name = pair(vllm, GEMMA3)
    saved = first.serve(request("a", LONG))
    remote_written(first, name, totals(saved)["stored_blocks"])
    shared = 300  # 18 blocks in common: the last anchor inside is block 12
    records = second.serve(request("b", [*LONG[:shared], *range(5000, 5100)]))
    assert sum(record.external_hits for record in records) == shared // BLOCK // SPACING * SPACING * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_a_one_group_sliding_window_model_serves_and_reuses(vllm: Instances) -> None:
    first, second, name = pair(vllm, "S")
    saved = first.serve(request("a", LONG))
    remote_written(first, name, totals(saved)["stored_blocks"])
    records = second.serve(request("b", LONG))
    assert sum(record.external_hits for record in records) == (len(LONG) - 1) // BLOCK * BLOCK
    assert totals(records)["loaded_blocks"] == WINDOW_BLOCKS, "a window is the whole load"
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_a_request_aborted_mid_prefill_keeps_what_it_stored_and_its_blocks_go_to_others(vllm: Instances) -> None:
    first, second, name = pair(vllm, GEMMA3)
    first.add(request("a", LONG))
    record = first.until_scheduled("a")
    assert record.output.num_scheduled_tokens["a"] == 256
    first.scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # its write-down still in flight
    reuse = first.serve(request("other", list(range(8000, 8300))))  # takes the freed blocks
    assert not [wrong for r in reuse for wrong in r.wrong_pages]
    assert totals([record])["stored_blocks"] == 16 + 3 * WINDOW_BLOCKS, "16 full blocks, the anchor's windows"
    remote_written(first, name, totals([record, *reuse])["stored_blocks"])
    records = second.serve(request("b", LONG[:256] + [1] * 10))
    assert sum(r.external_hits for r in records) == SPACING * BLOCK, "no window at 16: the anchor at 12"
    assert not [wrong for r in records for wrong in r.wrong_pages]


@pytest.mark.parametrize("pattern", ["FFMM", "SFMM"])
def test_a_model_with_mamba_state_is_declined_whole_and_still_serves(vllm: Instances, pattern: str) -> None:
    instance = vllm.new("mamba", cpu_topology(), kv_config=kv_config_of(pattern))
    records = instance.serve(request("a", LONG[:100])) + instance.serve(request("b", LONG[:100]))
    counts = totals(records)
    assert counts == {"declined_requests": 2}, "every request declined once, nothing stored or loaded"
    assert sum(record.external_hits for record in records) == 0
    assert not copied_blocks(records), "no job at all"
    assert not list(vllm.root.glob("tiercache-mamba-*")), "no CPU tier made for a model it declines"


def test_vllms_own_hit_below_and_a_load_above_it(vllm: Instances) -> None:
    first, second, name = pair(vllm, GEMMA3)
    saved = first.serve(request("a", LONG))
    remote_written(first, name, totals(saved)["stored_blocks"])
    second.serve(request("head", LONG[:170]))  # vLLM's own cache now holds 10 blocks of every group
    records = second.serve(request("b", LONG))
    assert second.new_request(records, "b").num_computed_tokens == 24 * BLOCK, "10 of vLLM's own, 14 loaded"
    assert sum(record.external_hits for record in records) == 14 * BLOCK
    assert totals(records)["loaded_blocks"] == 14 + 3 * WINDOW_BLOCKS
    assert not [wrong for record in records for wrong in record.wrong_pages]
