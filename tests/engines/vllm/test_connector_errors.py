"""Errors on time, through vLLM 0.33's own scheduler: a failed load's blocks reach vLLM in the step that read them,
on the V1 and V2 runners' call orders, with speculative decoding's too; every worker hook answering a broken
transfer engine without raising. (A hybrid job failing in one group: ``test_connector_staging``; vLLM's scheduler
takes no block-level load error from a model of several KV-cache groups, it raises on one: such a failure can only be
reported per request, as ``failed_recving`` of a request whose load is asynchronous.)

With speculative decoding vLLM collects a step's connector output before
``wait_for_save``, which runs after the drafter (``defer_finalize``), on both
runners: a load error known only at ``wait_for_save`` would reach vLLM a step
late, after it had kept a token computed over blocks that were never loaded.
A step's failed loads are read by the forward all the same (the copies were
to land before it); what matters is that vLLM hears of them in that step, so it
drops that step's token and recomputes. The failures are injected as a transfer
engine that fails loads (the CPU build's ``HostTransfers``, some groups' copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from support.vllm_connector import PROMPT, Instance, Instances, request, tiers_of, totals
from support.vllm_parts import cpu_topology

from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy, HostTransfers

CPU_SLOTS = 200


class FailingLoads(HostTransfers):
    """Loads of ``groups`` fail (their jobs' other copies are made)."""

    def __init__(self, pages: object, groups: set[int]) -> None:
        super().__init__(pages)  # type: ignore[arg-type]
        self.groups = groups

    def load(self, copies: Sequence[GroupCopy], *, asynchronous: bool = False) -> list[int]:
        broken = [copy.job_id for copy in copies if copy.group in self.groups]
        failed = super().load([copy for copy in copies if copy.group not in self.groups], asynchronous=asynchronous)
        self._step_failed.update(broken)
        return sorted({*failed, *self._failed(broken, "load (injected)", RuntimeError("injected"))})


class Broken(HostTransfers):
    """An engine whose completion queries fail (a CUDA error surfacing in ``Event.query``)."""

    def poll(self) -> Completed:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def drain(self) -> Completed:
        return self.poll()


def failing(instance: Instance, groups: set[int]) -> None:
    worker = instance.worker._worker
    worker.transfers = FailingLoads(worker.pages, groups)


def stored_then_reloaded(instance: Instance, tokens: list[int]) -> list:
    """Serve ``tokens`` (stored in the CPU tier), empty vLLM's own cache, serve them again: the second's steps."""
    instance.serve(request("first", tokens))
    instance.run(lambda: not instance.connector.has_pending_push_work())
    instance.scheduler.reset_prefix_cache()
    return instance.serve(request("again", tokens))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_failed_load_reaches_vllm_in_the_step_that_read_its_blocks(vllm: Instances, runner: str,
                                                                     speculative: bool) -> None:
    instance = vllm.new(f"{runner}-{speculative}", cpu_topology(blocks=CPU_SLOTS), runner=runner,
                        options={"loads": "sync"})  # a synchronous load's errors: blocks (asynchronous: per request)
    instance.speculative = speculative
    failing(instance, {0})
    records = stored_then_reloaded(instance, PROMPT)
    loading = [index for index, record in enumerate(records) if record.output.kv_connector_metadata.loads]
    assert len(loading) == 1
    (load,) = records[loading[0]].output.kv_connector_metadata.loads
    assert records[loading[0]].invalid_blocks == set(load.block_ids), "reported in its own step"
    read_wrong = [index for index, record in enumerate(records) if record.wrong_pages]
    assert read_wrong == loading, "no step vLLM kept read an unloaded page"
    assert totals(records).get("failed_loads") == 1
    occupancy = tiers_of(instance).stats()["tiers"]["cpu"]
    assert occupancy["free_blocks"] + occupancy["evictable_blocks"] == CPU_SLOTS, "the load's pins went back"


def test_every_worker_hook_answers_a_broken_engine_without_raising(vllm: Instances) -> None:
    instance = vllm.new("broken", cpu_topology())
    connector = instance.worker
    connector._worker.transfers = Broken(connector._worker.pages)
    assert connector.get_kv_connector_stats() is None
    assert connector.build_connector_worker_meta() is None
    assert connector.get_block_ids_with_load_errors() == set()
    assert connector.get_finished(set()) == (None, None)
    connector.shutdown()  # its drain raises: logged, and the region is let go all the same
    assert connector._worker.region.held._finalizer.alive is False
