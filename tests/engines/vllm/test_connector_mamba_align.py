"""Hybrid models with state layers under vLLM 0.33's own scheduler in ``mamba_cache_mode="align"``.

In align mode vLLM keeps, in block ``p`` of a state group, the state after
exactly ``p + 1`` blocks, at the ends its prefill chunks and decode steps stop
at. The connector stores a state block like a sliding window of one block, once
it is full, and a hit of ``N`` blocks needs every attention block up to ``N``
and the state block ``N - 1``, loaded into the block vLLM allocates there. The
state layers' "model" (``support.vllm_mamba.AlignState``) does what vLLM's
worker does: before the forward and the connector's loads, it moves each
request's state to the block the step ends in and checks it is the state of
the step's first token; a step that read a wrong or missing state is a wrong
page.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from support.vllm_connector import Instance, Instances, remote_written, request, totals
from support.vllm_mamba import AlignState, align_config, align_specs, align_tensors
from support.vllm_parts import BLOCK, cpu_topology, simulated_remote, vllm_config
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

from tiercache.integrations.vllm.connector.geometry import GroupKind, instance_geometry

LONG = list(range(2000, 2400))
"""400 tokens, 25 blocks: vLLM prefills 256, then 128 (its chunk stops at the last boundary, 384), then 16."""
PATTERN = "FFMM"
"""Two attention layers and two state layers: a full group and a state group of two layers each."""


def align_instance(vllm: Instances, name: str, remote: dict[str, Any], **options: Any) -> Instance:
    config = vllm_config(vllm.model, name, vllm.extra(cpu_topology(blocks=200, remotes=[remote]), **options))
    kv_config = align_config(PATTERN)(config)
    views, registered = align_tensors(kv_config)
    instance = Instance(config, kv_config, views, registered=registered, state_model=AlignState)
    vllm.built.append(instance)
    return instance


def pair(vllm: Instances, **options: Any) -> tuple[Instance, Instance]:
    remote = simulated_remote()
    return align_instance(vllm, "first", remote, **options), align_instance(vllm, "second", remote, **options)


def state_blocks(records: list, jobs: str) -> list[int]:
    """The vLLM blocks of the state group the steps' load or store jobs named."""
    return [block for record in records for job in getattr(record.output.kv_connector_metadata, jobs)
            for group, block in zip(job.groups, job.block_ids, strict=True) if group == 1]


def wrong(records: list) -> list:
    return [page for record in records for page in record.wrong_pages]


def test_the_connector_serves_an_align_mode_model_with_a_state_group(vllm: Instances) -> None:
    first, _ = pair(vllm)
    groups = first.kv_cache_config.kv_cache_groups
    assert [type(group.kv_cache_spec).__name__ for group in groups] == ["FullAttentionSpec", "MambaSpec"]
    geometry = instance_geometry(first.config, first.kv_cache_config).slots
    assert geometry is not None and [group.kind for group in geometry.groups] == [GroupKind.FULL, GroupKind.STATE]
    assert geometry.element_dtype is None, "no lossy level may quantize a state page"


def test_a_restart_restores_the_prompt_and_its_state_exactly(vllm: Instances) -> None:
    first, second = pair(vllm)
    saved = first.serve(request("a", LONG))
    assert not wrong(saved)
    counts = totals(saved)
    states = len(state_blocks(saved, "stores"))
    assert states == 3, "the states at 256, 384 and 400 tokens, where vLLM's chunks stopped; never an interior one"
    assert counts["stored_blocks"] == 25 + states
    remote_written(first, "sim", counts["stored_blocks"])
    records = second.serve(request("b", LONG))
    assert sum(record.external_hits for record in records) == 24 * BLOCK, "the prompt but its last block"
    assert totals(records)["loaded_blocks"] == 24 + 1, "24 attention blocks and the state after them"
    assert len(state_blocks(records, "loads")) == 1
    assert not wrong(records), "the state vLLM continued from is the state after 384 tokens"


def test_a_chats_next_turn_continues_from_the_state_decode_left(vllm: Instances) -> None:
    first, second = pair(vllm)
    turn = request("turn1", LONG, max_tokens=20)
    saved = first.serve(turn)
    remote_written(first, "sim", totals(saved)["stored_blocks"])
    computed = len(turn.all_token_ids) - 1
    records = second.serve(request("turn2", [*turn.all_token_ids, *range(3000, 3030)]))
    assert sum(record.external_hits for record in records) == computed // BLOCK * BLOCK
    assert not wrong(saved + records)


def test_a_prompt_sharing_a_prefix_hits_at_the_last_state_inside_it(vllm: Instances) -> None:
    """300 tokens in common: K/V is held for 18 blocks, a state only where vLLM stopped (16 blocks)."""
    first, second = pair(vllm)
    saved = first.serve(request("a", LONG))
    remote_written(first, "sim", totals(saved)["stored_blocks"])
    records = second.serve(request("b", [*LONG[:300], *range(5000, 5100)]))
    assert sum(record.external_hits for record in records) == 256
    assert not wrong(records)


def test_kv_held_without_a_state_at_its_end_is_never_served_alone(vllm: Instances) -> None:
    """A 200-token prompt leaves a state only at 192 tokens; a prompt sharing 180 finds K/V for 11 blocks and no
    state at or below them: nothing is loaded, all of it is recomputed."""
    first, second = pair(vllm)
    saved = first.serve(request("a", LONG[:200]))
    assert len(state_blocks(saved, "stores")) == 1
    remote_written(first, "sim", totals(saved)["stored_blocks"])
    records = second.serve(request("b", [*LONG[:180], *range(6000, 6040)]))
    assert sum(record.external_hits for record in records) == 0
    assert not totals(records).get("loaded_blocks")
    assert not wrong(records)


def test_sync_loads_asked_for_still_load_before_the_state_is_read(vllm: Instances) -> None:
    """vLLM moves a new request's state before the step's loads: a model with a state group loads asynchronously
    whatever ``loads`` says, so the state is in place a step before the forward reads it."""
    first, second = pair(vllm, loads="sync")
    saved = first.serve(request("a", LONG))
    remote_written(first, "sim", totals(saved)["stored_blocks"])
    records = second.serve(request("b", LONG))
    assert totals(records).get("async_loads") == 1
    assert not wrong(records)


def geometry_of(spec: dict[str, Any] | None = None, hash_block_size: int | None = None,
                speculative: Any = None) -> Any:
    """The connector's geometry for a full-attention and an align-mode state group, ``spec`` changed."""
    state = dataclasses.replace(align_specs("M")["model.layers.0.self_attn.attn"], **(spec or {}))
    attention = align_specs("F")["model.layers.0.self_attn.attn"]
    kv_cache_config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a"], attention),
                                                       KVCacheGroupSpec(["m"], state)],
                                      hash_block_size=hash_block_size)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                                  cache_config=SimpleNamespace(), speculative_config=speculative)
    return instance_geometry(vllm_config, kv_cache_config)


@pytest.mark.parametrize(("change", "reason"), [
    ({"spec": {"mamba_cache_mode": "none"}}, "only 'align'"),
    ({"spec": {"mamba_cache_mode": "all"}}, "only 'align'"),
    ({"spec": {"num_speculative_blocks": 2}}, "speculative decoding"),
    ({"spec": {"block_size": 2 * BLOCK}}, "block sizes"),
    ({"speculative": SimpleNamespace(use_eagle=lambda: True)}, "speculative decoding"),
    ({"hash_block_size": BLOCK // 2}, "finer than its blocks"),
])
def test_state_groups_it_cannot_restore_decline_every_request(change: dict[str, Any], reason: str) -> None:
    assert geometry_of().slots is not None
    declined = geometry_of(**change)
    assert declined.slots is None and reason in (declined.declined or "")


def test_a_lossy_level_is_declined_for_a_model_with_state(vllm: Instances, caplog: pytest.LogCaptureFixture) -> None:
    """State pages name no element dtype: a remote's lossy levels are declined and the pages stored exact."""
    remote = {**simulated_remote(), "codec": {"levels": ["int8", "exact"]}}
    first = align_instance(vllm, "lossy", remote)
    assert not wrong(first.serve(request("a", LONG)))
    assert "codec levels ['int8', 'exact'] declined, storing exact KV" in caplog.text


def test_a_preempted_request_resumes_from_its_stored_prefix_and_state(vllm: Instances) -> None:
    """A pool too small for two requests: vLLM preempts one (its blocks freed) and resumes it from the prefix and
    state the connector stored for it, and neither reads a wrong state."""
    config = vllm_config(vllm.model, "small", vllm.extra(cpu_topology(blocks=200, remotes=[simulated_remote()])))
    kv_config = align_config(PATTERN, blocks=60)(config)
    views, registered = align_tensors(kv_config)
    instance = Instance(config, kv_config, views, registered=registered, state_model=AlignState)
    vllm.built.append(instance)
    first = instance.add(request("a", LONG, max_tokens=60))
    second = instance.add(request("b", list(range(3000, 3400)), max_tokens=60))
    records = instance.run(lambda: first.is_finished() and second.is_finished())
    assert sum(len(record.output.preempted_req_ids or ()) for record in records) >= 1
    assert state_blocks(records, "loads"), "the resumed request loaded a state"
    assert not wrong(records)


def test_vllms_own_hit_below_and_a_load_above_it_with_the_state_at_the_top(vllm: Instances) -> None:
    """vLLM's own cache holds the first 10 blocks and their state; the connector loads the 14 blocks above and the
    state after 24, and vLLM continues from the loaded state, not its own."""
    first, second = pair(vllm)
    saved = first.serve(request("a", LONG))
    remote_written(first, "sim", totals(saved)["stored_blocks"])
    second.serve(request("head", LONG[:170]))  # vLLM's own cache: 10 blocks and the state after them
    records = second.serve(request("b", LONG))
    assert second.new_request(records, "b").num_computed_tokens == 24 * BLOCK
    assert sum(record.external_hits for record in records) == 14 * BLOCK
    assert len(state_blocks(records, "loads")) == 1
    assert not wrong(records)
