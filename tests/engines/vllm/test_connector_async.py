"""Copies that complete steps after the step that issued them, through vLLM 0.33's own scheduler.

On CUDA (``staged``) a step's pages leave vLLM's blocks within the step, on
the compute stream (gathered into staging), and reach the CPU slots later, on
a side stream; a job is reported when its event has passed, one or more steps
on. ``Deferred`` is that timing on this machine: the same page copies at once,
their completion handed back only ``LAG`` polls later. The protocol holds:
nothing waits in ``wait_for_save``; vLLM keeps stepping while jobs are out
(``has_pending_push_work``) so a store is committed with no request left; a
request that finishes or aborts while its store is out frees its blocks, and
another request writing them changes nothing of what was stored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from support.vllm_connector import PROMPT, Instance, Instances, request, totals
from support.vllm_parts import BLOCK, cpu_topology
from vllm.v1.request import RequestStatus

from tiercache.integrations.vllm.connector.transfers import Completed, HostTransfers

LAG = 3
"""Polls (about steps) between a copy and its completion."""
OTHER = [5 + (7 * index) % 500 for index in range(1000)]
"""A prompt sharing nothing with ``PROMPT``, long enough to take nearly every block of vLLM's pool."""


class Deferred(HostTransfers):
    """``HostTransfers`` whose completions are handed back ``LAG`` polls late (the side stream's timing)."""

    def __init__(self, pages) -> None:
        super().__init__(pages)
        self._late: deque[Completed] = deque([Completed() for _ in range(LAG)])

    def end_step(self, loads: Sequence[int], stores: Sequence[int]) -> None:
        super().end_step(loads, stores)
        self._late[-1].add(super().poll())

    def poll(self) -> Completed:
        self._late.append(Completed())
        return self._late.popleft()


def deferred(instance: Instance) -> Instance:
    worker = instance.worker._worker
    worker.transfers = Deferred(worker.pages)
    return instance


def blocks_given(records: list, req_id: str) -> set[int]:
    """Every block vLLM's scheduler gave ``req_id`` in ``records`` (new, then added step by step)."""
    given: set[int] = set()
    for record in records:
        for new in record.output.scheduled_new_reqs:
            if new.req_id == req_id:
                given.update(new.block_ids[0])
        cached = record.output.scheduled_cached_reqs
        for position, cached_id in enumerate(cached.req_ids):
            if cached_id == req_id and cached.new_block_ids[position]:
                given.update(cached.new_block_ids[position][0])
    return given


def test_a_store_reported_steps_later_lands_with_no_request_left(vllm: Instances) -> None:
    instance = deferred(vllm.new("late", cpu_topology()))
    req = instance.add(request("a", PROMPT))
    records = instance.run(req.is_finished)
    assert not totals(records).get("stored_blocks") or instance.connector.has_pending_push_work()
    assert instance.scheduler.has_requests(), "vLLM keeps stepping while the store is out"
    idle = instance.run(lambda: not instance.scheduler.has_requests())
    assert len(idle) >= 1 and not any(record.output.num_scheduled_tokens for record in idle)
    instance.scheduler.reset_prefix_cache()  # what follows can only come from the CPU tier: committed
    again = instance.serve(request("b", PROMPT))
    assert instance.new_request(again, "b").num_computed_tokens == 6 * BLOCK
    assert not [wrong for record in again for wrong in record.wrong_pages]


def test_wait_for_save_returns_with_the_store_still_out(vllm: Instances) -> None:
    instance = deferred(vllm.new("out", cpu_topology()))
    instance.add(request("a", PROMPT))
    first = instance.step()
    assert totals([first])["stored_blocks"] == 6
    assert instance.connector.has_pending_push_work(), "the store is not reported in its own step"
    assert dict(instance.connector._scheduler._in_flight), "its slots are not committed yet"


def test_blocks_freed_and_rewritten_while_a_store_is_out_change_nothing_stored(vllm: Instances) -> None:
    instance = deferred(vllm.new("reuse", cpu_topology(blocks=128)))
    first = instance.add(request("a", PROMPT))
    freed = instance.new_request(instance.run(first.is_finished), "a").block_ids[0][:6]
    assert instance.connector.has_pending_push_work(), "a's store is still out"
    instance.scheduler.reset_prefix_cache()  # vLLM's own cache forgets them: the blocks go to the next request
    other = instance.add(request("o", OTHER))
    assert set(freed) <= blocks_given(instance.run(other.is_finished), "o"), "the other request took and wrote them"
    instance.run(lambda: not instance.connector.has_pending_push_work())
    instance.scheduler.reset_prefix_cache()
    again = instance.serve(request("b", PROMPT))
    assert instance.new_request(again, "b").num_computed_tokens == 6 * BLOCK
    assert not [wrong for record in again for wrong in record.wrong_pages], "what was stored is the first request's"


def test_a_request_aborted_mid_prefill_with_its_store_out(vllm: Instances) -> None:
    instance = deferred(vllm.new("abort", cpu_topology(blocks=128)))
    long_prompt = list(range(3, 3 + 600))  # three steps of 256 tokens
    instance.add(request("a", long_prompt))
    first = instance.step()
    assert totals([first])["stored_blocks"] == 256 // BLOCK
    instance.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    other = instance.add(request("o", OTHER))
    instance.run(other.is_finished)
    instance.run(lambda: not instance.connector.has_pending_push_work())
    instance.scheduler.reset_prefix_cache()
    again = instance.serve(request("b", long_prompt[:256]))
    assert instance.new_request(again, "b").num_computed_tokens == 256 - BLOCK, "the first chunk, stored"
    assert not [wrong for record in again for wrong in record.wrong_pages]
