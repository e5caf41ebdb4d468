"""``TierCacheConnector``: tiercache as a vLLM KV connector (``KVConnectorBase_V1``), for ``vllm serve`` on GPU
and on vLLM's CPU build.

vLLM builds one per role: in its engine-core process the scheduler's
(``ConnectorScheduler``: tiercache's ``LowerTiers``, the bookkeeping, policies and
remotes; with the ``host`` option a ``HostTiers``, the same calls made of a host
cache server), in each worker process the worker's (``ConnectorWorker``: page copies
between vLLM's KV tensors and the CPU tier's shared slots, the host server's region
with ``host``). Both derive the same
slot geometry (``geometry``) and namespace (``namespace``) from vLLM's configs. Every hook is
guarded: an error inside tiercache is logged and becomes a miss, a failed job or
a load vLLM recomputes, never an exception in vLLM's loop. The one error raised
on purpose is at start, in a worker's ``register_kv_caches``: a CPU tier its
``shared_dir`` has no room for (``RegionSpaceError``, naming the size, the path,
``shared_dir`` and ``capacity_bytes``), which the operator must fix; any other
error there declines every request while vLLM serves on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.integrations.vllm.connector.geometry import describe_groups, instance_geometry
from tiercache.integrations.vllm.connector.host_mapping import HostMapping
from tiercache.integrations.vllm.connector.levels import LevelReads
from tiercache.integrations.vllm.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.metrics import (
    SchedulerCounters,
    TierCacheConnectorStats,
    TierCachePromMetrics,
)
from tiercache.integrations.vllm.connector.namespace import model_identity, page_format
from tiercache.integrations.vllm.connector.options import ConnectorOptions
from tiercache.integrations.vllm.connector.region import RegionDeclined, SharedRegion, region_path
from tiercache.integrations.vllm.connector.scheduler import ConnectorScheduler
from tiercache.integrations.vllm.connector.step_budget import StoreBudget
from tiercache.integrations.vllm.connector.token_order import compact_order
from tiercache.integrations.vllm.connector.worker import ConnectorWorker
from tiercache.manager.lower_tiers import LowerTiers

if TYPE_CHECKING:
    from tiercache.host.client import HostTiers

log = logging.getLogger(f"vllm.{__name__}")
"""Under vLLM's logger: its handlers and level (``VLLM_LOGGING_LEVEL``) apply in its processes."""
T = TypeVar("T")


def guarded(fallback: Callable[[], Any]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a hook; on an exception inside tiercache log it and answer ``fallback()`` (never raise into vLLM)."""

    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def run(self: TierCacheConnector, *args: Any, **kwargs: Any) -> T:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                log.exception("tiercache connector: %s failed; answering as a miss", method.__name__)
                return fallback()

        return run

    return wrap


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """tiercache's CPU tier and remotes under vLLM's own prefix cache (see the module docstring); every KV-cache
    group of vLLM's hybrid allocator, or none (a model whose state it cannot restore: every request declined)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        options = ConnectorOptions.parse(self._kv_transfer_config.kv_connector_extra_config)
        instance = instance_geometry(vllm_config, kv_cache_config)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._declined = instance.declined
        """Why every request is declined (None: the connector serves this model)."""
        self._declines = SchedulerCounters()
        self._declined_ids: set[str] = set()
        """Requests counted as declined (vLLM asks again for a request it could not schedule yet)."""
        groups = describe_groups(kv_cache_config)
        if instance.slots is None:
            if role == KVConnectorRole.SCHEDULER:
                log.warning("tiercache connector: KV-cache groups %s; declines every request: %s", groups,
                            self._declined)
            return
        geometry = instance.slots
        formats = page_format(vllm_config, kv_cache_config, geometry)
        config = options.config(model_identity(vllm_config), geometry, formats)
        order = compact_order(config, vllm_config, kv_cache_config, geometry)
        num_slots = config.tiers[0].capacity_blocks
        path = region_path(options.shared_dir, self._kv_transfer_config.engine_id,
                           vllm_config.parallel_config.data_parallel_rank)
        if role == KVConnectorRole.SCHEDULER:
            log.info("tiercache connector: KV-cache groups %s", groups)
            tiers = self._scheduler_tiers(options, config, path, num_slots, geometry)
            if tiers is None:
                return
            events = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
            staged = str(getattr(vllm_config.device_config, "device_type", "")) == "cuda"  # only CUDA stages stores
            budget = StoreBudget(geometry, options.staging_bytes, vllm_config.scheduler_config.max_num_batched_tokens,
                                 bounded=staged)
            self._scheduler = ConnectorScheduler(tiers, geometry, options.force_latest, events=bool(events),
                                                 idle_wait_s=options.idle_wait_s, load_mode=options.loads,
                                                 store_budget=budget)
            self._levels = LevelReads(tiers.level_blocks)
        else:
            host = HostMapping(config, options.host) if options.host is not None else None
            self._worker = ConnectorWorker(geometry, num_slots, path, _tensor_parallel_rank(), host=host,
                                           staging_bytes=options.staging_bytes,
                                           max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                                           num_blocks=getattr(kv_cache_config, "num_blocks", None),
                                           token_order=order,
                                           micro_batches=bool(getattr(vllm_config.parallel_config, "use_ubatching",
                                                                      False)))

    def _scheduler_tiers(self, options: ConnectorOptions, config: Any, path: Any, num_slots: int,
                         geometry: Any) -> LowerTiers | HostTiers | None:
        """The tiers under vLLM's pool, started: the host server's (``host``), or this instance's own over the
        region its workers made (None: a worker declined, and so does every request)."""
        if options.host is not None:
            from tiercache.host.client import HostTiers

            tiers: LowerTiers | HostTiers = HostTiers(config, options.host)
        else:
            try:
                region = SharedRegion.for_scheduler(path, num_slots, geometry.slot_bytes, geometry.world)
            except RegionDeclined as declined:
                self._declined = f"a worker cannot map vLLM's KV cache: {declined}"
                log.warning("tiercache connector: declines every request: %s", self._declined)
                return None
            tiers = LowerTiers(config, cpu_buffer=region.slots)
            self._region = region
        tiers.start()
        return tiers

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a later miss, never a request to recompute."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No: loads land in ``start_load_kv`` and stores left by per-layer hooks at ``wait_for_save``, so FULL CUDA
        graphs (whose replay runs no hook) keep their speed and lose nothing."""
        return False

    # ---- scheduler side ------------------------------------------------------------------
    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:  # a model this connector declines
            if self._declined is not None and request.request_id not in self._declined_ids:
                self._declined_ids.add(request.request_id)
                self._declines.add("declined_requests")
            return 0, False
        if not self._kv_transfer_config.is_kv_consumer:  # a kv_producer writes only (but keeps the request)
            self._scheduler.track(request)
            return 0, False
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    @guarded(lambda: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.allocated(request, blocks.get_block_ids(), num_external_tokens)

    @guarded(TierCacheConnectorMetadata)
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return TierCacheConnectorMetadata()
        scheduler = self._scheduler
        scheduler.preempted(scheduler_output.preempted_req_ids or ())
        return scheduler.step_metadata(scheduler_output, store=self._kv_transfer_config.is_kv_producer)

    @guarded(lambda: None)
    def update_connector_output(self, connector_output: Any) -> None:
        report = connector_output.kv_connector_worker_meta
        if self._scheduler is not None:
            self._scheduler.workers_reported(report if isinstance(report, TierCacheWorkerMetadata) else None)

    @guarded(dict)
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The tokens of this request's load by the tier that held them: the CPU tier as host memory, a file tier as
        disk, Redis and regional stores as a remote store (vLLM's ``external_unspecified``)."""
        if self._scheduler is None or not num_external_tokens:
            return {}
        sources: dict[CacheHitSource, int] = {}
        types = self._scheduler.tiers.types  # a host server's are known once attached
        for tier, tokens in self._scheduler.hit_tokens(request.request_id).items():
            source = _hit_source(types[tier])
            sources[source] = sources.get(source, 0) + tokens
        if sum(sources.values()) != num_external_tokens:  # vLLM accepted fewer tokens than offered
            return {self._cache_hit_source: num_external_tokens}
        return sources

    @guarded(lambda: False)
    def has_pending_push_work(self) -> bool:
        """While copies are in flight (CUDA: they complete after their step), vLLM keeps stepping until the workers
        reported them, so a store is committed even when no request is left."""
        return self._scheduler is not None and self._scheduler.has_pending()

    @guarded(lambda: False)
    def reset_cache(self) -> bool | None:
        """Drop every entry of the CPU tier nothing holds now (``/reset_prefix_cache``); remote stores keep theirs:
        other instances share them, and their own TTLs and eviction expire them."""
        if self._scheduler is None:
            return True
        dropped = self._scheduler.tiers.reset_cpu_tier()
        log.info("tiercache connector: reset dropped %d blocks of the CPU tier (remotes untouched)", dropped)
        return True

    @guarded(lambda: (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    @guarded(lambda: (False, None))
    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's ``request_finished``: every store is in flight already, nothing to delay."""
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._declined_ids.discard(request.request_id)
        if self._scheduler is not None:
            self._scheduler.finished(request)
        return False, None

    @guarded(list)
    def take_events(self) -> Iterable[Any]:
        return self._scheduler.take_events() if self._scheduler is not None else []

    @guarded(lambda: None)
    def get_kv_connector_stats(self) -> TierCacheConnectorStats | None:
        """The scheduler side's counts (with the blocks the remotes served per codec level); a worker's bytes and copy
        time per direction (summed over workers)."""
        if self._worker is not None:
            moved = self._worker.take_moved()
            return TierCacheConnectorStats(data=moved) if moved else None
        if self._scheduler is None:
            return self._declines.take()
        for name, count in self._levels.take().items():
            self._scheduler.counters.add(name, count)
        return self._scheduler.counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierCacheConnectorStats | None:
        return TierCacheConnectorStats(data=dict(data)) if data is not None else TierCacheConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TierCachePromMetrics:
        return TierCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's tensors as pages and the shared CPU tier; a layout it cannot map declines every request (a
        startup error in the log naming the backend, shape and strides), a model it declines maps nothing. Guarded
        inside the worker (``ConnectorWorker.register_kv_caches``): its one exception is the start-up error of a
        region that cannot be made (see the module docstring)."""
        if self._declined is None:
            self._worker_part.register_kv_caches(kv_caches, _attention_backends(self._vllm_config, kv_caches),
                                                 kv_cache_config=self._kv_cache_config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bind(connector_metadata)

    @guarded(lambda: None)
    def _bind(self, metadata: KVConnectorMetadata) -> None:
        if isinstance(metadata, TierCacheConnectorMetadata) and self._worker is not None:
            self._worker.bind(metadata)

    @guarded(lambda: None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Every layer of the step's loads, now: with CUDA graphs no per-layer hook runs."""
        if self._worker is not None:
            self._worker.start()

    @guarded(lambda: None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads were copied in ``start_load_kv``; a runner that skipped it gets them before its first
        layer (asynchronous ones wait for ``start_load_kv``, after the forward is launched)."""
        if self._worker is not None:
            self._worker.start(asynchronous=False)

    @guarded(lambda: None)
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.after_layer(layer_name)

    @guarded(lambda: None)
    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end()

    @guarded(lambda: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    @guarded(KVConnectorTransferResults)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests whose asynchronous loads ended (a failed one also in ``failed_recving``: recomputed)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        received, failed = self._worker.take_received()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    @guarded(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """This step's failed loads' blocks, whether or not ``wait_for_save`` has run yet (the V2 runner and
        speculative decoding ask before it)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    @guarded(lambda: None)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_report() if self._worker is not None else None

    @property
    def _worker_part(self) -> ConnectorWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler's connector")
        return self._worker

    def shutdown(self) -> None:
        """Close each side on its own (one failing does not keep the other open)."""
        if self._scheduler is not None:
            self._close(self._scheduler.close)
        if self._worker is not None:
            self._close(self._worker.close)

    @guarded(lambda: None)
    def _close(self, close: Callable[[], None]) -> None:
        close()


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed group)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no group initialised (a single process): rank 0
        return 0


def _hit_source(tier_type: str) -> CacheHitSource:
    """vLLM's name for where a tiercache tier's blocks come from."""
    return {"cpu": CacheHitSource.HOST, "file": CacheHitSource.DISK}.get(tier_type, CacheHitSource.EXTERNAL_UNSPECIFIED)


def _attention_backends(vllm_config: Any, kv_caches: dict[str, Any]) -> dict[str, str]:
    """Each layer's attention backend, by vLLM's name for it (for a layout error; empty where vLLM has no layers)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(kv_caches))  # type: ignore[type-abstract]
        return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}
    except Exception:  # no model built in this process (tests), or another vLLM
        return {}
