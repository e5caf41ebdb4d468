"""The worker side: each step's jobs handed to the transfer engine, layer by layer, and their completion reported.

Each step the scheduler side sends jobs (``metadata``). Loads are copied for every
layer in ``start_load_kv``, before the forward: with CUDA graphs (FULL, or
vLLM's V2 runner replaying one) the per-layer hooks never run, so a load that
waited for them would never land; a load never started (no ``start_load_kv``)
fails and its blocks are reported (``get_block_ids_with_load_errors``) so vLLM
recomputes them, never serves them. A store's pages are copied after each layer
wrote them (``save_kv_layer``); layers no hook ran for are copied at the step's
end (``wait_for_save``, which never waits: the copies may complete steps later).
Each layer copies its own KV-cache group's share of a job; a replicated group
(MLA) is stored by rank 0 only. Every job is reported back once, when its
copies completed (``transfers``: polled, never waited for).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiercache.common.units import US_PER_SECOND
from tiercache.integrations.vllm.connector.geometry import SlotGeometry, UnsupportedLayoutError
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.pages import KVPages, page_views
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.transfers import Completed, GroupCopy, HostTransfers, Transfers

log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _StepStore:
    """A store job of this step and the layers it still has to copy."""

    job: CopyJob
    copies: dict[int, GroupCopy]
    """Per KV-cache group this rank copies, its pages."""
    layers_left: set[int] = field(default_factory=set)
    failed: bool = False


def _group_copies(job: CopyJob, groups: set[int]) -> dict[int, GroupCopy]:
    """A job's pairs per KV-cache group, for the groups in ``groups``."""
    copies: dict[int, GroupCopy] = {}
    for group in sorted(set(job.groups) & groups):
        ours = [index for index, g in enumerate(job.groups) if g == group]
        copies[group] = GroupCopy(job.job_id, group, tuple(job.slots[i] for i in ours),
                                  tuple(job.block_ids[i] for i in ours))
    return copies


class ConnectorWorker:
    """One worker's half of the connector (see the module docstring)."""

    def __init__(self, geometry: SlotGeometry, num_slots: int, region_path: Any, rank: int, *,
                 staging_bytes: int | None = None, num_blocks: int | None = None) -> None:
        self.geometry = geometry
        self.num_slots = num_slots
        self.region_path = region_path
        self.rank = rank
        self.staging_bytes = staging_bytes
        self.num_blocks = num_blocks
        """vLLM's blocks per layer (a cache in kernel blocks has a multiple of it as rows)."""
        self.pages: KVPages | None = None
        self.region: SharedRegion | None = None
        self.transfers: Transfers | None = None
        groups = range(len(geometry.groups))
        self._loaded_groups = set(groups)
        self._stored_groups = {group for group in groups if geometry.writes(rank, group)}
        self._loads: list[CopyJob] = []
        self._loads_started: set[int] = set()
        """This step's loads whose copies were started."""
        self._loads_failed: set[int] = set()
        """This step's loads whose copies failed to start."""
        self._invalid: set[int] = set()
        """Loads in flight that vLLM counts blocks of that no slot fills: reported failed when complete."""
        self._stores: list[_StepStore] = []
        self._done: Counter[int] = Counter()
        self._failed: Counter[int] = Counter()
        self._load_errors: set[int] = set()
        self._receiving: dict[int, str] = {}
        """Asynchronous loads in flight: job id -> its request (reported to vLLM as received once copied)."""
        self._received: set[str] = set()
        self._failed_receives: set[str] = set()
        self._moved = Completed()
        self._polled = False
        """The transfer engine was polled since this step's metadata was bound."""

    def register_kv_caches(self, kv_caches: Mapping[str, Any], backends: Mapping[str, str] | None = None) -> None:
        """Map the shared CPU slots and vLLM's tensors as pages; a layout it cannot map declines (logged, the
        scheduler told through the region), never stops vLLM."""
        try:
            views = page_views(kv_caches, self.geometry, self.num_blocks, backends)
        except UnsupportedLayoutError as error:
            log.error("tiercache connector: cannot map vLLM's KV cache, so it declines every request: %s", error)
            SharedRegion.decline(self.region_path, self.rank, str(error))
            return
        self.region = SharedRegion.for_worker(self.region_path, self.num_slots, self.geometry.slot_bytes, self.rank)
        self.pages = KVPages(views, self.geometry, self.rank, self.region.slots)
        if self.pages.device.type == "cuda":
            self.transfers = StagedTransfers(self.pages, self.geometry, self.rank, self.region.slots,
                                             self.staging_bytes)
        else:
            self.transfers = HostTransfers(self.pages)
        log.info("tiercache connector: rank %d, %s transfers, pages: %s", self.rank,
                 type(self.transfers).__name__, self.pages.describe())

    def bind(self, metadata: TierCacheConnectorMetadata) -> None:
        """A step's jobs, bound before its forward."""
        self._loads, self._loads_started, self._polled = list(metadata.loads), set(), False
        self._stores = []
        budget = self.transfers.step_budget_bytes if self.transfers is not None else None
        for job in metadata.stores:
            store = _StepStore(job, _group_copies(job, self._stored_groups))
            store.layers_left = {i for i, layer in enumerate(self._layers()) if layer.group in store.copies}
            if budget is not None:
                budget -= sum(self.geometry.groups[g].layers_bytes * len(c.slots) for g, c in store.copies.items())
                if budget < 0:
                    log.warning("tiercache connector: store %d is past this step's staging budget; not stored",
                                job.job_id)
                    store.failed = True
            self._stores.append(store)

    def start(self, *, asynchronous: bool = True) -> None:
        """Copy every layer of the step's synchronous loads into their blocks now, before the forward reads any;
        with ``asynchronous`` its asynchronous loads too (vLLM starts those after the forward is launched: their
        requests are not in it)."""
        if self.transfers is None:
            return
        jobs = [job for job in self._loads
                if job.job_id not in self._loads_started and (asynchronous or not job.asynchronous)]
        self._loads_started.update(job.job_id for job in jobs)
        copies = [copy for job in jobs for copy in _group_copies(job, self._loaded_groups).values()]
        if copies:
            self._loads_failed.update(self.transfers.load(copies))

    def after_layer(self, layer_name: str) -> None:
        """A layer has written this step's KV: copy that layer's pages of the step's stores."""
        layer = self.pages.index.get(layer_name) if self.pages is not None else None
        if layer is not None:
            self._store(layer)

    def end(self) -> None:
        """The step's forward is over: copy what no hook copied, hand the step's jobs over, report loads that
        never started as failed."""
        if self.transfers is None:
            return
        for layer in range(len(self._layers())):
            self._store(layer)
        loads_ok = []
        for job in self._loads:
            if job.job_id not in self._loads_started or job.job_id in self._loads_failed:
                log.warning("tiercache connector: load %d was never copied; vLLM recomputes its blocks", job.job_id)
                self._failed[job.job_id] += 1
                if job.asynchronous:
                    self._received.add(job.request_id)
                    self._failed_receives.add(job.request_id)
                else:
                    self._load_errors.update(job.block_ids)
                    self._load_errors.update(job.invalid)
                continue
            if job.asynchronous:
                self._receiving[job.job_id] = job.request_id
            if job.invalid:
                if not job.asynchronous:
                    self._load_errors.update(job.invalid)
                self._invalid.add(job.job_id)
            loads_ok.append(job.job_id)
        stores_ok = []
        for store in self._stores:
            if store.failed:
                self._failed[store.job.job_id] += 1
            else:
                stores_ok.append(store.job.job_id)
        self.transfers.end_step(loads_ok, stores_ok)
        self._polled = False  # what the step's end completed is taken at the next ask
        self._loads, self._stores, self._loads_failed = [], [], set()

    def _store(self, layer: int) -> None:
        assert self.transfers is not None
        group = self._layers()[layer].group
        pending = [s for s in self._stores if not s.failed and layer in s.layers_left and group in s.copies]
        if not pending:
            return
        failed = set(self.transfers.store_layer(layer, [s.copies[group] for s in pending]))
        for store in pending:
            store.layers_left.discard(layer)
            store.failed |= store.job.job_id in failed

    def _layers(self) -> list[Any]:
        return self.pages.layers if self.pages is not None else []

    def _poll(self) -> None:
        """Take what the transfer engine completed into the next report and the next stats (once a step: vLLM
        asks for the received requests, the errors, the stats and the report one after the other)."""
        if self.transfers is not None and not self._polled:
            self._polled = True
            completed = self.transfers.poll()
            for job_id in completed.done:
                invalid = job_id in self._invalid
                (self._failed if invalid else self._done)[job_id] += 1
                self._invalid.discard(job_id)
                self._received_load(job_id, failed=invalid)
            for job_id in completed.failed:
                self._failed[job_id] += 1
                self._received_load(job_id, failed=True)
            self._moved.add(completed)

    def take_report(self) -> TierCacheWorkerMetadata | None:
        """The jobs completed (and failed) since the last report."""
        self._poll()
        if not self._done and not self._failed:
            return None
        report = TierCacheWorkerMetadata(self._done, self._failed)
        self._done, self._failed = Counter(), Counter()
        return report

    def take_moved(self) -> dict[str, int]:
        """Bytes and microseconds each direction's copies took since the last call (this rank)."""
        self._poll()
        moved, self._moved = self._moved, Completed()
        counts = {
            "load_copy_bytes": moved.load_bytes, "load_copy_us": round(moved.load_seconds * US_PER_SECOND),
            "store_copy_bytes": moved.store_bytes, "store_copy_us": round(moved.store_seconds * US_PER_SECOND),
        }
        return {name: count for name, count in counts.items() if count}

    def _received_load(self, job_id: int, *, failed: bool) -> None:
        """An asynchronous load ended: its request is reported received (and failed: vLLM recomputes it)."""
        request_id = self._receiving.pop(job_id, None)
        if request_id is not None:
            self._received.add(request_id)
            if failed:
                self._failed_receives.add(request_id)

    def take_received(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous loads ended since the last call, and those of them that failed (a
        failed one is reported per request: vLLM cannot map a block error to a request of several KV-cache
        groups)."""
        self._poll()
        received, failed = self._received, self._failed_receives
        self._received, self._failed_receives = set(), set()
        return received, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Wait for copies in flight (shutdown: the region must outlive them)."""
        if self.transfers is not None:
            self.transfers.drain()
