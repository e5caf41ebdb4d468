"""``TierCacheTier``: a tiercache remote topology as a vLLM 0.33 secondary offloading tier.

vLLM's ``TieringOffloadingSpec`` keeps its own GPU<->pinned-CPU copies and
cascades chunks from its CPU tier (the primary) into secondary tiers. This tier
puts a ``RemoteStore`` there: every remote topology tiercache has (Redis, Redis
Cluster, regional + central, file, simulated) with its options, TLS/AUTH, MAC
secret, lanes, breakers and deadlines. vLLM builds it as
``cls(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **config)``;
the config keys are the constructor's keyword arguments.

- Keys: vLLM's ``OffloadKey`` (block hash + KV group) inside the namespace of
  ``namespace.offloading_namespace`` (model, dtype, chunk bytes, parallel sizes and rank).
- ``lookup`` answers from memory (the store's presence cache, ``RemoteStore.presence``):
  RETRY while the tiers' answer is in flight, never a wait; a step's new keys go out
  as one ``contains`` per tier at ``on_schedule_end``. A HIT makes vLLM reserve a primary row; ``submit_load``
  later reads straight into ``primary_kv_view`` rows, ``submit_store`` writes
  straight from them (no copy in Python); ``get_finished_jobs`` reports each job
  once, a failed load with the keys that did arrive (their neighbours are MISS
  afterwards). A store reported finished is in a shared tier (a Redis SET
  acknowledged), so another vLLM instance of the namespace finds it.
- Failures (a server down, slow, or serving garbage) are misses and failed jobs;
  nothing raises into vLLM's scheduler, and no value that fails the codec's
  checks reaches the primary's memory.
- Events: with ``enable_kv_events`` (and vLLM's KV events on), each chunk a
  tiercache tier stored is an ``OffloadingEvent`` (medium STORAGE, ownership
  ``tiercache:<tier>``). Counters reach vLLM's stats as ``metrics.DEFINITIONS``.

Every method runs under vLLM's manager lock; the store's own loop thread never
calls back into vLLM.
"""

# ruff: noqa: E402 - vLLM is imported after the version check below
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from tiercache.integrations.vllm.version import TIERING_SERIES, require_vllm

require_vllm(TIERING_SERIES, "TierCacheTier (tiercache.integrations.vllm.offloading.tier)")

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.config.remote import remote_topology
from tiercache.integrations.vllm.offloading.jobs import Job, JobBook
from tiercache.integrations.vllm.offloading.metrics import DEFINITIONS, StatsDelta
from tiercache.integrations.vllm.offloading.namespace import offloading_namespace
from tiercache.remote.answers import resolved
from tiercache.remote.store import RemoteStore
from tiercache.tiers.base import Presence

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger(__name__)

OWNERSHIP_PREFIX = "tiercache:"
"""An event's ``ownership``: this prefix and the tiercache tier's topology name, then, for a keyed namespace,
``@`` and the start of its key id: vLLM's block hashes do not depend on tiercache's secret, so this is what
tells a router that two differently keyed fleets' chunks are not one another's."""
OWNERSHIP_KEY_ID_BYTES = 8
"""Bytes of the key id (hex) in a keyed namespace's ``ownership``."""
CONFIG_KEYS = ("topology", "overrides", "force_latest", "enable_kv_events", "locality")
"""What a ``secondary_tiers`` entry may set besides vLLM's own ``type``, ``module_path``, ``backpressure``."""


class TierCacheTier(SecondaryTierManager):
    """A tiercache remote topology under vLLM's tiering spec (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        topology: str | Mapping[str, Any] | None = None,
        overrides: Mapping[str, Any] | None = None,
        force_latest: bool = False,
        enable_kv_events: bool = False,
        locality: str | None = None,
        **unknown: Any,
    ) -> None:
        """``topology``: a remote-only tiercache YAML file (or the same as a mapping); ``overrides``: dotted
        field paths applied to it (``{"tiers.redis.options.url": "redis://h:6379"}``); ``force_latest``: read
        the newest version committed at central (needs a regional topology); ``enable_kv_events``: emit
        ``OffloadingEvent``s for stored chunks; ``locality``: vLLM's LOCAL/REMOTE label for them."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if unknown:
            raise ValueError(
                f"secondary tier {tier_type!r}: unknown option(s) {sorted(unknown)}; "
                f"TierCacheTier takes {', '.join(CONFIG_KEYS)} (and vLLM's type, module_path, backpressure)"
            )
        if topology is None:
            raise ValueError(
                f"secondary tier {tier_type!r}: 'topology' is required: the path of a tiercache remote-only "
                "topology YAML (e.g. tiercache's configs/remote/redis.yaml), or the same as a mapping"
            )
        self.locality = Locality(locality) if locality is not None else None
        self.force_latest = bool(force_latest)
        events = enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        if enable_kv_events and not events:
            log.warning("secondary tier %r: enable_kv_events is set but vLLM's KV events are off", tier_type)
        remote = remote_topology(topology, f"secondary tier {tier_type!r}", overrides)
        if self.force_latest and not remote.versioned:
            raise ValueError(
                f"secondary tier {tier_type!r}: force_latest needs a versioned tier (type: regional) in "
                f"{remote.source}; its tiers are {[tier.name for tier in remote.tiers]}"
            )
        self.store = RemoteStore(
            remote, offloading_namespace(offloading_spec.config, self.block_size_bytes), self.block_size_bytes,
            record_events=events,
        )
        key_id = self.store.namespace.key_id
        self._ownership_suffix = f"@{key_id[:OWNERSHIP_KEY_ID_BYTES].hex()}" if key_id else ""
        self._rows = primary_kv_view.cast("B")
        self._jobs = JobBook()
        self._stats = StatsDelta()
        self.store.start()

    # -- rows of the primary -------------------------------------------------

    def _views(self, chunk_ids: Iterable[int]) -> list[memoryview]:
        size, rows = self.block_size_bytes, self._rows
        return [rows[int(chunk) * size : (int(chunk) + 1) * size] for chunk in chunk_ids]

    # -- lookups -------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        answer = self.store.presence([key], req_context.req_id)
        if answer is None:
            return LookupResult.RETRY  # vLLM's manager treats a secondary tier's HIT_PENDING like a miss
        return LookupResult.HIT if answer[0].presence is Presence.HELD else LookupResult.MISS

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.store.forget_presence(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.store.flush_presence()

    # -- jobs ----------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, False, lambda keys, views: self.store.write(keys, views, engine_keys=True))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        def read(keys: list[OffloadKey], views: list[memoryview]) -> Future[list[bool]]:
            return self.store.read(keys, views, force_latest=self.force_latest, engine_keys=True)

        self._submit(job_metadata, True, read)

    def _submit(
        self,
        job: TransferJob,
        is_promotion: bool,
        start: Callable[[list[OffloadKey], list[memoryview]], Future[list[bool]]],
    ) -> None:
        """Start a job's transfer over its chunks' rows; one that fails to start is a failed job, reported once."""
        keys = list(job.keys)
        try:
            future = start(keys, self._views(job.chunk_ids))
        except Exception:
            kind = "load" if is_promotion else "store"
            log.exception("tiercache tier %r: %s job %d failed to start", self.tier_type, kind, job.job_id)
            future = resolved([False] * len(keys))
        self._jobs.add(job.job_id, keys, is_promotion, future)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [self._result(job) for job in self._jobs.finished()]

    def _result(self, job: Job) -> JobResult:
        oks = job.outcome()
        moved = sum(oks)
        timing = {"transfer_time": job.ended - job.started, "transfer_bytes": moved * self.block_size_bytes}
        if moved == len(oks):
            return JobResult(job.job_id, True, **timing)
        if not job.is_promotion:
            return JobResult(job.job_id, False, **timing)
        # marked not held while their requests run, or vLLM would promote them again forever
        self.store.presence_cache.mark_absent([key for key, ok in zip(job.keys, oks, strict=True) if not ok])
        arrived = tuple(key for key, ok in zip(job.keys, oks, strict=True) if ok)
        return JobResult(job.job_id, False, successful_keys=arrived or None, **timing)

    @override
    def has_pending_work(self) -> bool:
        return bool(len(self._jobs)) or self.store.presence_cache.busy

    @override
    def drain_jobs(self) -> None:
        self._jobs.wait_all()

    @override
    def shutdown(self) -> None:
        self.store.close()
        try:
            self._rows.release()  # let vLLM unmap its region (an export left behind keeps it mapped)
        except BufferError:
            log.warning("tiercache tier %r: primary rows still referenced at shutdown", self.tier_type)

    # -- events and stats ----------------------------------------------------

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        return [
            OffloadingEvent(
                keys=list(stored.keys),  # the OffloadKeys the jobs named (engine_keys=True)
                medium=self.medium,
                removed=False,
                locality=self.locality,
                ownership=OWNERSHIP_PREFIX + stored.tier + self._ownership_suffix,
            )
            for stored in self.store.take_events()
        ]

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return dict(DEFINITIONS)

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._stats.take(self.store.counters())

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("tiercache_topology", "tiercache_tiers", "tiercache_force_latest")

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {
            "tiercache_topology": self.store.topology.source,
            "tiercache_tiers": ",".join(self.store.names),
            "tiercache_force_latest": self.force_latest,
        }
