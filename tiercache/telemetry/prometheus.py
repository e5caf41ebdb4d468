"""Prometheus exposition of stats(): one collector, a registry and the text format (the metrics extra)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tiercache.common.units import MS_PER_SECOND
from tiercache.telemetry.counters import LATENCY_BUCKETS_MS, Metrics

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


GAUGE_FIELDS = frozenset(
    {
        "capacity_blocks",
        "cached_blocks",
        "free_blocks",
        "evictable_blocks",
        "breaker_state",
        "lane_breaker_state",
        "pending_stores",
        "late_calls_in_flight",
    }
)
"""Fields that go up and down; every other number in ``stats()`` is a monotonic counter."""


TIER_OWN_STATS = "store"
"""Key under which ``stats()`` nests a remote tier's own counters (exported as ``store_<name>``)."""


METRIC_PREFIX = "tiercache"


_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(*parts: str) -> str:
    return _NAME_UNSAFE.sub("_", "_".join((METRIC_PREFIX, *parts)))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float))


class TierCacheCollector:
    """A Prometheus collector over ``TierManager.stats()`` (and, when given, the raw histograms).

    Each scrape calls ``stats`` once, so the exposition is a consistent snapshot of
    per-tier hits, misses, bytes, evictions, drops, breaker state and queue depths.
    Latency histograms come from ``metrics`` with their real buckets (milliseconds
    converted to seconds); without it, only the summaries in ``stats()`` are exported.
    Needs ``prometheus-client`` (the ``metrics`` extra), imported on first use.
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]], metrics: Metrics | None = None) -> None:
        self._stats = stats
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snapshot = self._stats()
        families: dict[str, Any] = {}

        def family(stat: str, kind: type, documentation: str, labels: list[str]) -> Any:
            name = _metric_name("tier", stat)
            if name not in families:
                families[name] = kind(name, documentation, labels=labels)
            return families[name]

        for tier, values in snapshot.get("tiers", {}).items():
            own = values.get(TIER_OWN_STATS, {})
            flat = {**{k: v for k, v in values.items() if k != TIER_OWN_STATS}, **{
                f"{TIER_OWN_STATS}_{k}": v for k, v in own.items() if not isinstance(v, Mapping)
            }}
            curve = values.get("mrc", {}).get("hit_ratio", {})
            for multiple, ratio in curve.items():
                family(
                    "mrc_hit_ratio", GaugeMetricFamily, "hit ratio at a multiple of the capacity (live MRC)",
                    ["tier", "capacity_multiple"],
                ).add_metric([tier, multiple], float(ratio))
            for stat, value in flat.items():
                if isinstance(value, Mapping):
                    if self._metrics is None and "mean_ms" in value:
                        for statistic in ("mean_ms", "p50_ms", "p99_ms"):
                            family(
                                f"{stat}_{statistic}", GaugeMetricFamily, f"{stat} {statistic}", ["tier"]
                            ).add_metric([tier], float(value.get(statistic, 0.0)))
                    continue
                if isinstance(value, str):
                    family(f"{stat}_info", GaugeMetricFamily, f"{stat} as text", ["tier", stat]).add_metric(
                        [tier, value], 1.0
                    )
                elif _is_number(value):
                    if stat.removeprefix(f"{TIER_OWN_STATS}_") in GAUGE_FIELDS:
                        family(stat, GaugeMetricFamily, f"{stat} (gauge)", ["tier"]).add_metric([tier], float(value))
                    else:
                        family(stat, CounterMetricFamily, f"{stat} (counter)", ["tier"]).add_metric(
                            [tier], float(value)
                        )
        queues = snapshot.get("queues", {})
        for stat, value in queues.items():
            name = _metric_name("queue", stat)
            if isinstance(value, Mapping):
                gauge = GaugeMetricFamily(name, f"transfer queue {stat} per remote tier", labels=["tier"])
                for tier, depth in value.items():
                    gauge.add_metric([tier], float(depth))
                families[name] = gauge
            elif _is_number(value):
                families[name] = GaugeMetricFamily(name, f"transfer queue {stat}", value=float(value))
        if self._metrics is not None:
            name = _metric_name("latency_seconds")
            histogram = HistogramMetricFamily(name, "operation latency per tier", labels=["tier", "operation"])
            for tier, operation, counts, total, total_ms in self._metrics.histograms():
                buckets, seen = [], 0
                for bound, count in zip(LATENCY_BUCKETS_MS, counts, strict=False):
                    seen += count
                    buckets.append((repr(bound / MS_PER_SECOND), seen))
                buckets.append(("+Inf", total))
                histogram.add_metric([tier, operation], buckets, total_ms / MS_PER_SECOND)
            families[name] = histogram
        yield from families.values()


def prometheus_registry(stats: Callable[[], Mapping[str, Any]], metrics: Metrics | None = None) -> Any:
    """A fresh ``prometheus_client.CollectorRegistry`` holding one ``TierCacheCollector``."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCacheCollector(stats, metrics))
    return registry


def render_prometheus(stats: Mapping[str, Any], metrics: Metrics | None = None) -> str:
    """Prometheus text exposition of one ``stats()`` snapshot."""
    from prometheus_client import generate_latest

    return generate_latest(prometheus_registry(lambda: stats, metrics)).decode()
