"""The ``worker_order`` section of ``gpu_connector.py``: the connector's ``ConnectorWorker`` driven in vLLM's call
order, its forward faked as kernels on the compute stream (issue 53).

vLLM 0.33's V1 model runner (``kv_connector_model_runner_mixin``) makes these
calls each step, which the connector hands to its worker: ``bind_connector_metadata``
(``bind``), ``start_load_kv`` (``start``), per attention layer
``wait_for_layer_load`` -> the layer's kernels -> ``save_kv_layer``
(``after_layer``), ``wait_for_save`` (``end``), then ``get_finished``,
``get_block_ids_with_load_errors`` and ``build_connector_worker_meta``
(``take_received``, ``take_load_errors``, ``take_report``). With speculative
decoding the last three come before ``wait_for_save``, which runs after the
drafter's kernels (``SPECULATIVE``).

The fake forward delays the compute stream (``torch.cuda._sleep``) before each
layer, then reads the blocks the step loads (a copy kept for the comparison)
and writes fresh bytes into the blocks it stores; the next step writes over
those blocks at once (vLLM reuses a freed block). The engine is the worker's
own ``StagedTransfers`` with ``Widened`` streams (delayed side streams, poisoned
staging, the ``--break`` guard off). Each order runs a store, a load of it back
into other blocks, and a load of a slot that is none: judged are the pages the
forward read (equal to what the store's forward wrote), the failed load's
blocks among the step's load errors before its ``wait_for_save``, and every job
reported once, done or failed.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from gpu_connector_parts import POISON, SLEEP_CYCLES, Check, Widened, one_group

from tiercache.integrations.vllm.connector.geometry import SlotGeometry
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata
from tiercache.integrations.vllm.connector.pages import KVPages
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.worker import ConnectorWorker

ORDERS = ("v1", "speculative")
SPECULATIVE = "speculative"
"""The order where vLLM takes the step's errors and report before ``wait_for_save``."""
BLOCKS = 32
STORED = 8
"""Blocks a store covers (and the load reads back)."""
REPORT_WAIT_S = 5.0
"""How long empty steps are run for a job's report (a hang guard, not a figure)."""
STORE, LOAD, BAD_LOAD = 1, 2, 3


class WidenedWorker(ConnectorWorker):
    """The connector's worker, its transfer engine built over ``Widened`` streams and the check's runtime (on CPU
    too: the same ``StagedTransfers``, its copies done at once)."""

    def __init__(self, check: Check, geometry: SlotGeometry, num_slots: int, region_path: Any) -> None:
        super().__init__(geometry, num_slots, region_path, 0, staging_bytes=4 * STORED * geometry.slot_bytes)
        self.check = check

    def _engine(self, pages: KVPages, region: SharedRegion) -> StagedTransfers:
        return StagedTransfers(pages, self.geometry, self.rank, region.slots, self.staging_bytes,
                               runtime=self.check.runtime,
                               streams=Widened(self.check.device, self.check.broken, SLEEP_CYCLES))


class Forward:
    """One step's fake forward over ``kv``, run through the worker's hooks in ``order``."""

    def __init__(self, check: Check, worker: ConnectorWorker, kv: dict[str, torch.Tensor], order: str) -> None:
        self.check, self.worker, self.kv, self.order = check, worker, kv, order
        self.done: Counter[int] = Counter()
        self.failed: Counter[int] = Counter()

    def step(self, metadata: TierCacheConnectorMetadata, reads: tuple[int, ...] = (),
             writes: tuple[int, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[int]]:
        """The pages each layer read of ``reads`` and wrote into ``writes``, and the load errors taken in the step."""
        worker, device = self.worker, self.check.device
        if worker.transfers is not None:
            for buffer in worker.transfers.pool._loads:  # a scatter that does not wait reads the poison
                if buffer.tensor is not None:
                    buffer.tensor.fill_(POISON)
        worker.bind(metadata)
        worker.start()
        read, written = {}, {}
        for name, view in self.kv.items():
            if self.check.cuda:
                torch.cuda._sleep(SLEEP_CYCLES)
            if reads:
                read[name] = view[torch.tensor(reads, device=device)].clone()
            if writes:
                fresh = torch.randint(0, 256, (len(writes), *view.shape[1:]), dtype=torch.uint8, device=device)
                view.index_copy_(0, torch.tensor(writes, device=device), fresh)
                written[name] = fresh
            worker.after_layer(name)
        errors: set[int] = set()
        if self.order == SPECULATIVE:
            errors = self._outputs()
            if self.check.cuda:  # the drafter's kernels
                torch.cuda._sleep(SLEEP_CYCLES)
        worker.end()
        if self.order != SPECULATIVE:
            errors = self._outputs()
        return read, written, errors

    def _outputs(self) -> set[int]:
        self.worker.take_received()
        errors = self.worker.take_load_errors()
        report = self.worker.take_report()
        if report is not None:
            self.done.update(report.done)
            self.failed.update(report.failed)
        return errors

    def until_reported(self, job: int) -> bool:
        """Empty steps until ``job`` is reported (the scheduler loads only what its store reported)."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while job not in self.done and job not in self.failed and time.monotonic() < deadline:
            self.step(TierCacheConnectorMetadata())
        return job in self.done or job in self.failed


def worker_order(check: Check, shape: dict[str, int]) -> dict[str, Any]:
    """Each of ``ORDERS``: a store, its load back into other blocks, a load of a slot that is none."""
    results: dict[str, Any] = {}
    for order in ORDERS:
        kv = check.kv("LBNHC", shape, BLOCKS)
        geometry = one_group(kv)
        path = check.dir / f"tiercache-worker-{order}-dp0"
        worker = WidenedWorker(check, geometry, BLOCKS, path)
        worker.register_kv_caches(kv)
        forward = Forward(check, worker, kv, order)
        slots, stored_on = check.scattered(STORED, BLOCKS), check.scattered(STORED, BLOCKS - 2)
        loaded_into = tuple(block for block in range(BLOCKS - 2) if block not in stored_on)[:STORED]
        groups = (0,) * STORED
        _, written, _ = forward.step(TierCacheConnectorMetadata(stores=[CopyJob(STORE, slots, stored_on, groups)]),
                                     writes=stored_on)
        forward.step(TierCacheConnectorMetadata(), writes=stored_on)  # the freed blocks reused at once
        stored = forward.until_reported(STORE)
        bad = tuple(range(BLOCKS - 2, BLOCKS))
        loads = [CopyJob(LOAD, slots, loaded_into, groups), CopyJob(BAD_LOAD, (BLOCKS + 7, 0), bad, (0, 0))]
        read, _, errors = forward.step(TierCacheConnectorMetadata(loads=loads), reads=loaded_into)
        forward.until_reported(LOAD)
        worker.close()
        equal = stored and all(torch.equal(read[name], written[name]) for name in kv)
        reported = dict(forward.done) == {STORE: 1, LOAD: 1} and dict(forward.failed) == {BAD_LOAD: 1}
        results[order] = {"pages_equal": equal, "errors_in_step": sorted(errors), "done": dict(forward.done),
                          "failed": dict(forward.failed)}
        check.checks[f"worker in vLLM's {order} order: the forward reads what the store's forward wrote"] = equal
        check.checks[f"worker in vLLM's {order} order: a failed load's blocks are errors in its step"] = (
            errors == set(bad))
        check.checks[f"worker in vLLM's {order} order: every job reported once"] = reported
    return results
