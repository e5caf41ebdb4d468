"""The worker side: each step's jobs handed to the transfer engine, layer by layer, and their completion reported.

Each step the scheduler side sends jobs (``metadata``). Loads are copied for every
layer in ``start_load_kv``, before the forward: with CUDA graphs (FULL, or
vLLM's V2 runner replaying one) the per-layer hooks never run, so a load that
waited for them would never land. A store's pages are copied after each layer
wrote them (``save_kv_layer``); layers no hook ran for are copied at the step's
end (``wait_for_save``, which never waits: the copies may complete steps later).
Under micro-batching (vLLM's dual-batch overlap, ``use_ubatching``) each
micro-batch runs every layer's hooks in turn, so a layer's first
``save_kv_layer`` comes before the other micro-batch has written that layer:
then every store is copied at the step's end instead (``per_layer_saves``).
Each layer copies its own KV-cache group's share of a job; a replicated group
(MLA) is stored by rank 0 only. Every job is reported back once, when its
copies completed (``transfers``: polled, never waited for).

Load errors are reported in the step they happen in, whatever the runner's
order: a load that fails to start, or that vLLM counts blocks of that no slot
fills, has its blocks in ``get_block_ids_with_load_errors`` from ``start_load_kv``
on; a load never started (no ``start_load_kv``) is settled as failed by whichever
of that call, ``build_connector_worker_meta`` and ``wait_for_save`` comes first
(vLLM's V2 runner, and V1 with speculative decoding, collect errors before
``wait_for_save``, which then runs after the drafter). vLLM recomputes those
blocks; it never serves them.

On CUDA what one step's stores stage on the device is bounded
(``store_budget_bytes``: the blocks ``max_num_batched_tokens`` can fill, or
``staging_mib``; the scheduler plans within it), and loads are staged in chunks
of half that; both are reserved when the KV caches are registered
(``staging``) and logged.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tiercache.common.units import US_PER_SECOND
from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry, UnsupportedLayoutError
from tiercache.integrations.vllm.connector.host_mapping import HostMapping
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.pages import KVPages, page_views, state_views
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.shmfile import RegionFile
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.staging import StagingMemoryError
from tiercache.integrations.vllm.connector.step_budget import staging_budget, step_blocks
from tiercache.integrations.vllm.connector.step_store import StepStore, group_copies
from tiercache.integrations.vllm.connector.token_order import TokenOrder
from tiercache.integrations.vllm.connector.transfers import Completed, HostTransfers, Transfers

if TYPE_CHECKING:
    from tiercache.host.region import HostRegion

log = logging.getLogger(f"vllm.{__name__}")

MIB = 1 << 20


class ConnectorWorker:
    """One worker's half of the connector (see the module docstring)."""

    def __init__(self, geometry: SlotGeometry, num_slots: int, region_path: Any, rank: int, *,
                 staging_bytes: int | None = None, max_num_batched_tokens: int | None = None,
                 num_blocks: int | None = None, token_order: TokenOrder | None = None,
                 micro_batches: bool = False, host: HostMapping | None = None) -> None:
        self.geometry = geometry
        self.host = host
        """The host server's region, mapped instead of a region of this instance's own (the ``host`` option)."""
        self._views: Any = None
        """vLLM's tensors as pages, kept until a host server's region is mapped."""
        self.token_order = token_order or TokenOrder(None)
        """The order the compact level decodes pages in, and the backends it holds for."""
        self.num_slots = num_slots
        self.region_path = region_path
        self.rank = rank
        self.staging_bytes = staging_bytes
        """``staging_mib``: what a step's stores stage on CUDA (None: derived from ``max_num_batched_tokens``)."""
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_blocks = num_blocks
        """vLLM's blocks per layer (a cache in kernel blocks has a multiple of it as rows)."""
        self.per_layer_saves = not micro_batches
        """Whether a layer's pages are copied at its ``save_kv_layer`` (not under micro-batching: see the module
        docstring), else all at the step's end."""
        self.pages: KVPages | None = None
        self.region: SharedRegion | None = None
        self.declined: RegionFile | None = None
        """The hold on the region's file of a worker that declined (until it closes)."""
        self.transfers: Transfers | None = None
        groups = range(len(geometry.groups))
        self._loaded_groups = set(groups)
        self._stored_groups = {group for group in groups if geometry.writes(rank, group)}
        self._loads: list[CopyJob] = []
        self._loads_started: set[int] = set()
        """This step's loads whose copies were started (or settled as never started)."""
        self._loads_settled: set[int] = set()
        """This step's loads no engine was given, reported failed already."""
        self._invalid: set[int] = set()
        """Loads in flight that vLLM counts blocks of that no slot fills: reported failed when complete."""
        self._stores: list[StepStore] = []
        self._done: Counter[int] = Counter()
        self._failed: Counter[int] = Counter()
        self._load_errors: set[int] = set()
        self._receiving: dict[int, str] = {}
        """Asynchronous loads in flight: job id -> its request (reported to vLLM as received once copied)."""
        self._received: set[str] = set()
        self._failed_receives: set[str] = set()
        self._moved = Completed()
        self._polled = False
        """The transfer engine was polled since the step's jobs were bound or handed over."""

    def register_kv_caches(self, kv_caches: Mapping[str, Any], backends: Mapping[str, str] | None = None, *,
                           kv_cache_config: Any = None) -> None:
        """Map the shared CPU slots and vLLM's tensors as pages (state layers placed by ``kv_cache_config``: see
        ``state_views``). A layout it cannot map, or an error of its own once the region is mapped, declines
        (logged, the scheduler told through the region), never stops vLLM; a region it cannot make
        (``RegionSpaceError``: no room on its file system; no access) or device staging it cannot reserve
        (``StagingMemoryError``, naming the size and ``staging_mib``) is a start-up error, raised."""
        try:
            if any(group.kind is GroupKind.STATE for group in self.geometry.groups):
                kv_caches = state_views(kv_caches, kv_cache_config, self.geometry,
                                        self.num_blocks or getattr(kv_cache_config, "num_blocks", 0))
            views = page_views(kv_caches, self.geometry, self.num_blocks, backends)
            wrong_order = self.token_order.mismatch(dict(backends or {}))
            if wrong_order is not None:
                raise UnsupportedLayoutError(wrong_order)
        except UnsupportedLayoutError as error:
            log.error("tiercache connector: cannot map vLLM's KV cache, so it declines every request: %s", error)
            self._decline(str(error))
            return
        if self.host is not None:
            self._views = views
            self.host.start()
            self._map_host()
            return
        self.region = SharedRegion.for_worker(self.region_path, self.num_slots, self.geometry.slot_bytes, self.rank)
        try:
            self._map(views, self.region)
        except StagingMemoryError:
            self.region.close()
            self.region = None
            raise

    def _map_host(self) -> None:
        """Map the host server's region once it has answered (``host_mapping``)."""
        assert self.host is not None
        region = self.host.mapped()
        if region is not None:
            self._map(self._views, region)
            self._views = None

    def _map(self, views: Any, region: SharedRegion | HostRegion) -> None:
        """vLLM's pages and the region's CPU slots, and the transfer engine between them."""
        try:
            self.pages = KVPages(views, self.geometry, self.rank, region.slots)
            self.transfers = self._engine(self.pages, region)
        except StagingMemoryError:  # a start that cannot afford the staging fails here, not in a forward
            self.pages = None
            raise
        except Exception as error:
            log.exception("tiercache connector: rank %d cannot copy vLLM's KV cache, so it declines every request",
                          self.rank)
            self.pages, self.transfers = None, None
            self._decline(f"rank {self.rank}: {error}")
            return
        log.info("tiercache connector: rank %d, %s (%s); pages: %s", self.rank, type(self.transfers).__name__,
                 self.transfers.describe(), self.pages.describe())

    def _engine(self, pages: KVPages, region: SharedRegion | HostRegion) -> Transfers:
        """The transfer engine for ``pages``' device; on CUDA with its staging bounds, logged."""
        if pages.device.type != "cuda":
            return HostTransfers(pages)
        budget = staging_budget(self.geometry, self.rank, self.staging_bytes, self.max_num_batched_tokens)
        chunk, how = None, "staging_mib"  # the scheduler plans against the same budget (``step_budget``)
        if self.staging_bytes is None and self.max_num_batched_tokens is not None:
            blocks = step_blocks(self.max_num_batched_tokens, self.geometry.block_size)
            chunk = max(1, blocks * self.geometry.rank_bytes // 2)
            how = (f"max_num_batched_tokens {self.max_num_batched_tokens} / block_size {self.geometry.block_size} + 1 "
                   f"= {blocks} blocks; staging_mib overrides")
        engine = StagedTransfers(pages, self.geometry, self.rank, region.slots, budget, load_chunk_bytes=chunk)
        if budget is not None:
            log.info("tiercache connector: rank %d stages at most %.0f MiB of stores a step (%s), loads in chunks of "
                     "%.0f MiB; %.0f MiB of device staging reserved", self.rank, budget / MIB, how,
                     engine.load_chunk_bytes / MIB, engine.pool.reserved_bytes / MIB)
        return engine

    def _decline(self, reason: str) -> None:
        if self.host is not None:  # no header of its own to say it in: its jobs fail (recomputed, dropped)
            return
        held = self.region.held if self.region is not None else None  # the decline takes the mapped file over
        self.region = None
        self.declined = SharedRegion.decline(self.region_path, self.rank, reason, held)

    def bind(self, metadata: TierCacheConnectorMetadata) -> None:
        """A step's jobs, bound before its forward. The scheduler plans stores within the step's staging budget
        (``step_budget``); stores past it all the same (a scheduler and workers of different options) are dropped
        (one warning)."""
        if self.host is not None and self.transfers is None and self._views is not None:
            self._map_host()
        self._loads, self._loads_started, self._polled = list(metadata.loads), set(), False
        self._stores = []
        region = self.host.token if self.host is not None else b""
        self._settle_loads([job for job in self._loads if job.region != region])  # slots of a region not mapped
        budget = self.transfers.step_budget_bytes if self.transfers is not None else None
        dropped = []
        for job in metadata.stores:
            store = StepStore(job, group_copies(job, self._stored_groups))
            if job.region != region:
                store.dropped = store.failed = True
                self._stores.append(store)
                continue
            store.layers_left = {i for i, layer in enumerate(self._layers()) if layer.group in store.copies}
            if budget is not None:
                cost = sum(self.geometry.groups[g].layers_bytes * len(c.slots) for g, c in store.copies.items())
                if cost > budget:
                    store.dropped = store.failed = True
                    dropped.append(store)
                else:
                    budget -= cost
            self._stores.append(store)
        if dropped:
            log.warning("tiercache connector: %d stores (%d blocks) are past this step's staging budget of %.0f MiB "
                        "and not stored (later misses); staging_mib in kv_connector_extra_config raises it",
                        len(dropped), sum(len(store.job.slots) for store in dropped),
                        (self.transfers.step_budget_bytes or 0) / MIB)

    def start(self, *, asynchronous: bool = True) -> None:
        """Copy every layer of the step's synchronous loads into their blocks now, before the forward reads any;
        with ``asynchronous`` its asynchronous loads too (vLLM starts those after the forward is launched: their
        requests are not in it). A load that fails has its blocks (or its request) reported at once."""
        if self.transfers is None:
            return
        jobs = [job for job in self._loads
                if job.job_id not in self._loads_started and (asynchronous or not job.asynchronous)]
        if not jobs:
            return
        try:
            failed: set[int] = set()
            for asynchronously in (False, True):
                copies = [copy for job in jobs if job.asynchronous is asynchronously
                          for copy in group_copies(job, self._loaded_groups).values()]
                if copies:
                    failed.update(self.transfers.load(copies, asynchronous=asynchronously))
        except Exception:  # the engine itself broke: nothing of these loads can be trusted
            log.exception("tiercache connector: loads %s failed to start", [job.job_id for job in jobs])
            self._settle_loads(jobs)
            return
        for job in jobs:
            self._loads_started.add(job.job_id)
            if job.asynchronous:  # its request is reported once the engine has reported the job
                self._receiving[job.job_id] = job.request_id
            if job.job_id in failed:
                if not job.asynchronous:
                    self._load_errors.update(job.block_ids)
                    self._load_errors.update(job.invalid)
            elif job.invalid:
                if not job.asynchronous:
                    self._load_errors.update(job.invalid)
                self._invalid.add(job.job_id)

    def _settle_loads(self, jobs: list[CopyJob] | None = None) -> None:
        """The step's loads (or ``jobs``) no engine was given: reported failed by this worker (nothing of theirs is
        in flight), to vLLM as their blocks (synchronous) or their request (asynchronous: vLLM takes a failed
        receive per request, never a block error of a model of several KV-cache groups)."""
        for job in self._loads if jobs is None else jobs:
            if job.job_id in self._loads_started:
                continue
            log.warning("tiercache connector: load %d was never copied; vLLM recomputes it", job.job_id)
            self._loads_started.add(job.job_id)
            self._loads_settled.add(job.job_id)
            self._failed[job.job_id] += 1
            if job.asynchronous:
                self._received.add(job.request_id)
                self._failed_receives.add(job.request_id)
            else:
                self._load_errors.update(job.block_ids)
                self._load_errors.update(job.invalid)

    def after_layer(self, layer_name: str) -> None:
        """A layer has written this step's KV: copy that layer's pages of the step's stores (under micro-batching
        only one micro-batch has: copied at the step's end)."""
        layer = self.pages.index.get(layer_name) if self.pages is not None and self.per_layer_saves else None
        if layer is not None:
            self._store(layer)

    def end(self) -> None:
        """The step's forward is over: copy what no hook copied, hand the step's jobs over."""
        self._settle_loads()
        if self.transfers is None:  # nothing copied: a store is reported failed (its slots are given back)
            for store in self._stores:
                self._failed[store.job.job_id] += 1
            self._loads, self._stores = [], []
            return
        for layer in range(len(self._layers())):
            self._store(layer)
        for store in self._stores:
            if store.dropped:
                self._failed[store.job.job_id] += 1
        loads = [job.job_id for job in self._loads if job.job_id not in self._loads_settled]
        self.transfers.end_step(loads, [store.job.job_id for store in self._stores if not store.dropped])
        self._loads, self._stores, self._loads_started, self._loads_settled = [], [], set(), set()
        self._polled = False  # what the step's end completed is taken at the next ask

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
                self._invalid.discard(job_id)
                self._received_load(job_id, failed=True)
            self._moved.add(completed)

    def _received_load(self, job_id: int, *, failed: bool) -> None:
        """An asynchronous load ended: its request is reported received (and failed: vLLM recomputes it)."""
        request_id = self._receiving.pop(job_id, None)
        if request_id is not None:
            self._received.add(request_id)
            if failed:
                self._failed_receives.add(request_id)

    def take_received(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous loads ended since the last call, and those of them that failed."""
        self._settle_loads()
        self._poll()
        received, failed = self._received, self._failed_receives
        self._received, self._failed_receives = set(), set()
        return received, failed

    def take_report(self) -> TierCacheWorkerMetadata | None:
        """The jobs completed (and failed) since the last report."""
        self._settle_loads()
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

    def take_load_errors(self) -> set[int]:
        """Blocks vLLM must recompute: this step's failed loads (settled now if never started) and earlier ones."""
        self._settle_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Wait for copies in flight (the region must outlive them), unregister the host memory, and let go of the
        region's file (removed if the scheduler side never took it)."""
        try:
            if self.transfers is not None:
                self.transfers.drain()
                self.transfers.close()
        finally:
            for held in (self.region, self.declined, self.host):
                if held is not None:
                    held.close()
