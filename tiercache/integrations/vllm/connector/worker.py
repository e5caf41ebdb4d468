"""The worker side: copies between vLLM's KV tensors and the shared CPU slots, layer by layer, as told.

Each step the scheduler side sends jobs (``metadata``). A load's pages are copied
into their blocks for each layer just before that layer's attention reads them
(``wait_for_layer_load``); a store's pages are copied out of their blocks right
after the layer wrote them (``save_kv_layer``); each layer copies its own
KV-cache group's share of a job. A layer the engine did not call
a hook for is done at the end of the step: a store then (its pages are complete
after the forward), a load as failed, since the forward has read the blocks
already: its blocks are reported (``get_block_ids_with_load_errors``) so vLLM
recomputes them, never serves them. Every finished job is reported back once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tiercache.integrations.vllm.connector.identity import SlotGeometry
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.pages import KVPages
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.movement.swap.handles import paired_runs

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """A job of this step and the layers it still has to copy."""

    job: CopyJob
    runs: dict[int, list[tuple[int, int, int]]]
    """Per KV-cache group, (first source, first destination, count): slot -> block for a load, block -> slot for a
    store."""
    layers_left: set[int] = field(default_factory=set)
    failed: bool = False
    """A copy of it raised: it is reported failed (a load's blocks recomputed, a store aborted)."""


def _runs(job: CopyJob, load: bool, group_layers: dict[int, list[int]]) -> _Job:
    """A job's copies as runs per group, with the layers of the groups it touches."""
    runs: dict[int, list[tuple[int, int, int]]] = {}
    for group in sorted(set(job.groups)):
        slots = [slot for slot, g in zip(job.slots, job.groups, strict=True) if g == group]
        blocks = [block for block, g in zip(job.block_ids, job.groups, strict=True) if g == group]
        runs[group] = paired_runs(slots, blocks) if load else paired_runs(blocks, slots)
    layers = {layer for group in runs for layer in group_layers[group]}
    return _Job(job, runs, layers)


class ConnectorWorker:
    """One worker's half of the connector (see the module docstring)."""

    def __init__(self, geometry: SlotGeometry, num_slots: int, region_path: Any, rank: int) -> None:
        self.geometry = geometry
        self.num_slots = num_slots
        self.region_path = region_path
        self.rank = rank
        self.pages: KVPages | None = None
        self.region: SharedRegion | None = None
        self._rows: list[torch.Tensor] = []
        """Per layer, this rank's pages of every slot: ``[num_slots, page_bytes]`` views of the region."""
        self._group_of = [group for group, spec in enumerate(geometry.groups) for _ in spec.layer_names]
        """Per layer (in the geometry's order), its KV-cache group."""
        self._group_layers: dict[int, list[int]] = {}
        for layer, group in enumerate(self._group_of):
            self._group_layers.setdefault(group, []).append(layer)
        self._loads: list[_Job] = []
        self._stores: list[_Job] = []
        self._done: Counter[int] = Counter()
        self._failed: Counter[int] = Counter()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Check vLLM's tensors against the geometry, then map the shared CPU slots."""
        self.pages = KVPages(kv_caches, self.geometry)
        self.region = SharedRegion.for_worker(self.region_path, self.num_slots, self.geometry.slot_bytes, self.rank)
        geometry, slots = self.geometry, self.region.slots
        self._rows = []
        for group, spec in enumerate(geometry.groups):
            for index in range(len(spec.layer_names)):
                start = geometry.offset(self.rank, group, index)
                self._rows.append(slots[:, start : start + spec.page_bytes])

    def bind(self, metadata: TierCacheConnectorMetadata) -> None:
        """A step's jobs, bound before its forward (so the layers' hooks copy as the forward goes)."""
        self._loads = [_runs(job, True, self._group_layers) for job in metadata.loads]
        self._stores = [_runs(job, False, self._group_layers) for job in metadata.stores]

    def start(self, forward: bool) -> None:
        """Loads may start; ``forward``: the engine runs a forward now (its layers will call the hooks), else
        nothing reads the blocks this step and every layer is loaded at once."""
        if not forward:
            for layer in range(len(self.geometry.layer_names)):
                self._copy_loads(layer)

    def before_layer(self, layer_name: str) -> None:
        """A layer's attention is about to read its KV: load that layer's pages."""
        layer = self._layer(layer_name)
        if layer is not None:
            self._copy_loads(layer)

    def after_layer(self, layer_name: str) -> None:
        """A layer has written this step's KV: save that layer's pages."""
        layer = self._layer(layer_name)
        if layer is not None:
            self._copy_stores(layer)

    def end(self) -> None:
        """The step's forward is over: finish the stores, fail loads a layer was never loaded for, report."""
        for layer in range(len(self.geometry.layer_names)):
            self._copy_stores(layer)
        for job in self._loads:
            if job.failed or job.layers_left:
                log.warning("tiercache connector: load %d missed layers %s; vLLM recomputes its blocks",
                            job.job.job_id, sorted(job.layers_left))
                self._failed[job.job.job_id] += 1
                self._load_errors.update(job.job.block_ids)
                self._load_errors.update(job.job.invalid)
            elif job.job.invalid:
                self._failed[job.job.job_id] += 1
                self._load_errors.update(job.job.invalid)
            else:
                self._done[job.job.job_id] += 1
        for job in self._stores:
            (self._failed if job.failed else self._done)[job.job.job_id] += 1
        self._loads, self._stores = [], []

    def _layer(self, layer_name: str) -> int | None:
        return None if self.pages is None else self.pages.index.get(layer_name)

    def _copy_loads(self, layer: int) -> None:
        pages = self.pages
        assert pages is not None
        group = self._group_of[layer]
        for job in self._loads:
            runs = job.runs.get(group, [])
            self._copy(job, layer, lambda runs=runs: pages.load(layer, runs, self._rows[layer]))

    def _copy_stores(self, layer: int) -> None:
        pages = self.pages
        assert pages is not None
        group = self._group_of[layer]
        for job in self._stores:
            runs = job.runs.get(group, [])
            self._copy(job, layer, lambda runs=runs: pages.save(layer, runs, self._rows[layer]))

    @staticmethod
    def _copy(job: _Job, layer: int, copy: Callable[[], None]) -> None:
        """One layer of one job; a copy that raises fails its job (reported at the step's end), not the others."""
        if job.failed or layer not in job.layers_left:
            return
        try:
            copy()
        except Exception:
            log.exception("tiercache connector: job %d failed at layer %d", job.job.job_id, layer)
            job.failed = True
            return
        job.layers_left.discard(layer)

    def take_report(self) -> TierCacheWorkerMetadata | None:
        """The jobs finished (and failed) since the last report."""
        if not self._done and not self._failed:
            return None
        report = TierCacheWorkerMetadata(self._done, self._failed)
        self._done, self._failed = Counter(), Counter()
        return report

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
