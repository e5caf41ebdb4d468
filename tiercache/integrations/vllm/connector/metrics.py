"""What the connector counts, as vLLM's connector stats (its log line) and Prometheus metrics (its ``/metrics``).

The scheduler side counts per step (``SchedulerCounters``); vLLM takes the counts
as ``TierCacheConnectorStats`` each step, carries them to its API server and
hands them to ``TierCachePromMetrics``, whose counters appear on vLLM's own
``/metrics`` as ``vllm:tiercache_<name>_total`` (``hit_blocks`` with a ``tier``
label: which tiercache tier served the blocks loaded; ``level_blocks`` with a
``level`` label: the codec level of the values the remotes served).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

PREFIX = "vllm:tiercache_"
TIER_SEPARATOR = ":"
"""``hit_blocks:<tier>`` counts blocks a tier served (a ``tier`` label in Prometheus), ``level_blocks:<level>``
blocks a remote served at a codec level (a ``level`` label)."""
LABELS = {"hit_blocks": "tier", "level_blocks": "level"}
"""The counts that carry a label, and its name."""
DOCUMENTATION = {
    "lookups": "Requests whose prompt tiercache looked up beyond vLLM's own prefix cache",
    "lookups_pending": "Scheduler steps a request waited for a remote's answer",
    "fetches_pending": "Scheduler steps a request waited for its blocks to arrive from a remote",
    "lookup_us": "Microseconds from a request's first lookup to its hit found (remote presence checks included)",
    "fetch_us": "Microseconds from a hit's fetch starting to its blocks offered to vLLM (remote reads)",
    "async_loads": "Loads copied while vLLM's batch ran on (the request waiting in WAITING_FOR_REMOTE_KVS)",
    "idle_wait_us": "Microseconds the scheduler waited for a remote while vLLM had nothing else to run",
    "offered_blocks": "Blocks tiercache offered to vLLM as external prefix-cache hits",
    "loaded_blocks": "Blocks copied from tiercache's CPU tier into vLLM's KV cache (one per KV-cache group)",
    "stored_blocks": "Blocks copied from vLLM's KV cache into tiercache's CPU tier (one per KV-cache group)",
    "loaded_bytes": "Bytes copied from tiercache's CPU tier into vLLM's KV cache (every rank's pages)",
    "stored_bytes": "Bytes copied from vLLM's KV cache into tiercache's CPU tier (every rank's pages)",
    "declined_requests": "Requests tiercache declined: the model holds state it does not restore (Mamba, linear "
                         "attention)",
    "failed_loads": "Load jobs a worker failed (their blocks recomputed by vLLM)",
    "failed_stores": "Store jobs a worker failed (nothing written)",
    "deferred_store_blocks": "Full-attention blocks past a step's device staging budget, stored at a later step",
    "dropped_store_blocks": "Blocks past a step's device staging budget that cannot wait (sliding windows; a block "
                            "larger than a whole step's budget), not stored (later misses)",
    "hit_blocks": "Blocks loaded, by the tiercache tier that served them",
    "level_blocks": "Blocks the remote tiers served, by the codec level of the values read (exact, int8, compact)",
    "load_copy_bytes": "Bytes the workers copied from the CPU tier into vLLM's KV cache (summed over workers)",
    "load_copy_us": "Microseconds the workers' loads took (summed over workers; CUDA: between the copies' events)",
    "store_copy_bytes": "Bytes the workers copied from vLLM's KV cache into the CPU tier (summed over workers)",
    "store_copy_us": "Microseconds the workers' stores took (summed over workers; CUDA: between the copies' events)",
}


class SchedulerCounters:
    """Counts since vLLM last took them."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        if amount:
            self._counts[name] += amount

    def take(self) -> TierCacheConnectorStats | None:
        if not self._counts:
            return None
        stats = TierCacheConnectorStats(data=dict(self._counts))
        self._counts.clear()
        return stats


@dataclass
class TierCacheConnectorStats(KVConnectorStats):
    """Counts of one interval (``data``: name -> count), summed when aggregated."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data)
        merged.update(other.data)
        return TierCacheConnectorStats(data=dict(merged))

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not self.data


class TierCachePromMetrics(KVConnectorPromMetrics):
    """The counts as Prometheus counters on vLLM's ``/metrics``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"{PREFIX}{name}", documentation=documentation,
                labelnames=labelnames + ([LABELS[name]] if name in LABELS else []),
            )
            for name, documentation in DOCUMENTATION.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        for key, count in transfer_stats_data.items():
            name, _, tier = str(key).partition(TIER_SEPARATOR)
            counter = self._counters.get(name)
            if counter is not None:
                counter.labels(*labels, *([tier] if tier else [])).inc(count)
