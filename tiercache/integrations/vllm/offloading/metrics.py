"""The tier's counters as vLLM offloading metrics (Prometheus through vLLM's own stats path).

``TieringOffloadingSpec`` collects each tier's ``build_metric_definitions`` and
aggregates what ``get_stats`` returns every step; the values are the
``RemoteStore``'s counters since the previous call, labelled by tiercache tier
(its topology name), presence check answer or write outcome.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata

PRESENCE_CHECKS = "vllm:kv_offload_tiercache_presence_checks"
READ_HITS = "vllm:kv_offload_tiercache_read_hits"
READ_MISSES = "vllm:kv_offload_tiercache_read_misses"
WRITES = "vllm:kv_offload_tiercache_writes"
TIER_LABEL = "tiercache_tier"
PRESENCE_LABEL = "presence"
OUTCOME_LABEL = "outcome"

DEFINITIONS: dict[str, OffloadingMetricMetadata] = {
    PRESENCE_CHECKS: OffloadingCounterMetadata(
        "Chunks whose presence was checked in tiercache's remote tiers, by answer: held, absent, or unknown (a "
        "tier could not tell: down, slow, breaker open; looked up as a miss).",
        (PRESENCE_LABEL,),
    ),
    READ_HITS: OffloadingCounterMetadata(
        "Chunks promoted from a tiercache tier into vLLM's CPU tier, by tiercache tier.", (TIER_LABEL,)
    ),
    READ_MISSES: OffloadingCounterMetadata(
        "Chunks a promotion could not read from any tiercache tier (missing, invalid, failed): recomputed.",
    ),
    WRITES: OffloadingCounterMetadata(
        "Chunks cascaded into tiercache's tiers, by outcome: stored, failed, dropped (back-pressure), "
        "write_back_dropped (a slower tier's hit not copied into a faster one).",
        (OUTCOME_LABEL,),
    ),
}

_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "presence_held": (PRESENCE_CHECKS, ("held",)),
    "presence_absent": (PRESENCE_CHECKS, ("absent",)),
    "presence_unknown": (PRESENCE_CHECKS, ("unknown",)),
    "read_misses": (READ_MISSES, ()),
    "writes_ok": (WRITES, ("stored",)),
    "writes_failed": (WRITES, ("failed",)),
    "writes_dropped": (WRITES, ("dropped",)),
    "write_backs_dropped": (WRITES, ("write_back_dropped",)),
}
"""RemoteStore counter -> (metric, label values); ``read_hits_<tier>`` is handled by prefix."""
READ_HITS_PREFIX = "read_hits_"


class StatsDelta:
    """Turns the store's running counters into the increments since the last ``take``."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, counters: dict[str, int]) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for name, value in counters.items():
            increase = value - self._last.get(name, 0)
            if increase <= 0:
                continue
            if name.startswith(READ_HITS_PREFIX):
                stats.increase_counter(READ_HITS, increase, (name[len(READ_HITS_PREFIX) :],))
            elif name in _COUNTERS:
                metric, labels = _COUNTERS[name]
                stats.increase_counter(metric, increase, labels)
        self._last = counters
        return None if stats.is_empty() else stats
