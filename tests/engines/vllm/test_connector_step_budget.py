"""The step's store budget applied where stores are planned (issue 53, #5), under vLLM 0.33's own scheduler.

On CUDA a worker stages a step's stores on the device, at most a budget a step.
The scheduler plans within it (``StoreBudget``), so the worker never drops a
planned job: full-attention blocks past it are stored at a later step. On CPU
nothing is staged and the budget is unbounded; these tests give the scheduler
the budget a CUDA instance gets (``staging_mib``'s bytes) through its
``store_budget``, then check every step's jobs and what a second instance loads.
"""

from __future__ import annotations

from support.vllm_connector import PROMPT, Instance, Instances, remote_written, request, totals
from support.vllm_parts import cpu_topology, simulated_remote

from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.step_budget import StoreBudget, staging_budget

BUDGET_BLOCKS = 5
"""Blocks a step may stage in these tests: two prompts of 6 blocks fill 12 in one step."""


def budgeted(instance: Instance, blocks: int) -> int:
    """Give ``instance``'s scheduler a CUDA instance's budget of ``blocks`` blocks (``staging_mib`` in bytes)."""
    scheduler = instance.connector._scheduler
    per_block = scheduler.geometry.groups[0].layers_bytes
    scheduler.store_budget = StoreBudget(scheduler.geometry, blocks * per_block, None)
    return per_block


def test_stores_past_a_steps_budget_wait_for_later_steps_and_every_block_is_stored(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    per_block = budgeted(first, BUDGET_BLOCKS)
    other = [token + 5000 for token in PROMPT]
    first.add(request("a", PROMPT, max_tokens=8))
    first.add(request("b", other, max_tokens=8))
    records = first.run(lambda: not first.scheduler.has_requests())
    planned = [sum(len(job.slots) for job in record.output.kv_connector_metadata.stores) for record in records]
    assert planned[0] == BUDGET_BLOCKS and max(planned) <= BUDGET_BLOCKS, planned
    counts = totals(records)
    assert counts["stored_blocks"] == 12 and counts["deferred_store_blocks"] == 7 + 2, counts
    assert "failed_stores" not in counts and "dropped_store_blocks" not in counts
    assert per_block * BUDGET_BLOCKS == first.connector._scheduler.store_budget.step_bytes[0]
    remote_written(first, "sim", 12)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    for req_id, tokens in (("c", PROMPT), ("d", other)):
        served = second.serve(request(req_id, tokens))
        assert second.new_request(served, req_id).num_computed_tokens == 6 * 16, "every block of it was stored"
        assert not [wrong for record in served for wrong in record.wrong_pages]


def test_the_budget_holds_on_every_rank_and_is_unbounded_where_nothing_is_staged() -> None:
    page = 1024
    full = GroupGeometry(GroupKind.FULL, ("model.layers.0.attn", "model.layers.1.attn"), page, replicated=True)
    window = GroupGeometry(GroupKind.SLIDING, ("model.layers.2.attn",), page, window_blocks=2)
    geometry = SlotGeometry((full, window), 2, 16)
    assert staging_budget(geometry, 0, None, 64) == 5 * 3 * page and staging_budget(geometry, 1, None, 64) == 5 * page
    budget = StoreBudget(geometry, None, 64)
    assert budget.fitting([1] * 9) == 5, "rank 1 stores only the window's pages: five of its blocks fill its budget"
    budget.spend(0)
    assert budget.fitting([0] * 10) == 6, "rank 0: 2 pages a full block, 13 of its 15 left"
    assert StoreBudget(geometry, None, 64, bounded=False).fitting([0] * 1000) == 1000, "CPU: nothing is staged"
    assert budget.ever_fits(0) and not StoreBudget(geometry, page, None).ever_fits(0), "2 pages past a 1-page step"

