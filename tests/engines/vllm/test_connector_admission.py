"""Admitting a remote hit under vLLM 0.33's own scheduler: waiting for the remote while vLLM has nothing else to
run, asking again while it runs others, and a hybrid model's ends asked about in one batch."""

from __future__ import annotations

from support.vllm_connector import PROMPT, Instance, Instances, remote_written, request, tiers_of, totals
from support.vllm_groups import kv_config_of
from support.vllm_parts import BLOCK, cpu_topology, simulated_remote

LATENCY_MS = 30
"""The simulated remote's latency per call: several of vLLM's steps."""
OTHER = list(range(600, 700))
"""A prompt no store holds."""


def reader_of_a_stored_prompt(vllm: Instances, **options: float) -> Instance:
    """A second instance over a slow remote that holds ``PROMPT``'s blocks, with the connector's ``options``."""
    remote = simulated_remote(latency_ms=0)
    writer = vllm.new("writer", cpu_topology(remotes=[remote]))
    writer.serve(request("w", PROMPT))
    remote_written(writer, "sim", 6)
    slow = {**remote, "options": {**remote["options"], "latency_ms": LATENCY_MS}}
    return vllm.new("reader", cpu_topology(remotes=[slow]), options=options)


def test_an_idle_engine_waits_for_the_remote_instead_of_spinning(vllm: Instances) -> None:
    reader = reader_of_a_stored_prompt(vllm, idle_wait_ms=1000)
    records = reader.serve(request("r", PROMPT))
    counts = totals(records)
    assert sum(record.external_hits for record in records) == 6 * BLOCK
    assert not counts.get("lookups_pending") and not counts.get("fetches_pending"), "admitted in the first step"
    assert counts["idle_wait_us"] >= LATENCY_MS * 1000, "it waited for the presence check and the read"
    assert counts["lookup_us"] >= LATENCY_MS * 1000 and counts["fetch_us"] >= LATENCY_MS * 1000


def test_without_an_idle_wait_vllm_is_told_to_ask_again(vllm: Instances) -> None:
    reader = reader_of_a_stored_prompt(vllm, idle_wait_ms=0)
    records = reader.serve(request("r", PROMPT))
    counts = totals(records)
    assert sum(record.external_hits for record in records) == 6 * BLOCK
    assert counts["lookups_pending"] >= 1 and counts["fetches_pending"] >= 1
    assert not counts.get("idle_wait_us")


def test_a_running_request_is_never_held_up_by_another_ones_remote(vllm: Instances) -> None:
    reader = reader_of_a_stored_prompt(vllm, idle_wait_ms=1000)
    decoding = reader.add(request("decoding", OTHER, max_tokens=200))
    reader.until_scheduled("decoding")
    waiting = reader.add(request("r", PROMPT))
    records = reader.run(lambda: waiting.is_finished())
    counts = totals(records)
    assert sum(record.external_hits for record in records) == 6 * BLOCK
    assert not decoding.is_finished(), "the decode ran on through the admission"
    assert counts["lookups_pending"] >= 1, "asked again while another request ran"
    assert not counts.get("idle_wait_us"), "never blocked a step that had a request to run"


def test_a_hybrid_request_asks_about_every_end_it_may_try_in_one_batch(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(blocks=200, remotes=[remote]), kv_config=kv_config_of("SSSF"))
    second = vllm.new("second", cpu_topology(blocks=200, remotes=[remote]), kv_config=kv_config_of("SSSF"))
    long = list(range(2000, 2400))
    remote_written(first, "sim", totals(first.serve(request("a", long)))["stored_blocks"])
    records = second.serve(request("b", [*long[:300], *range(5000, 5100)]))  # the hit ends at an earlier anchor
    assert sum(record.external_hits for record in records) > 0
    calls = tiers_of(second).parts.remotes[0].calls
    assert calls["contains"] == 1, "one batch of presence checks, whatever ends the lookup tried"
