"""Counters and latency histograms per tier, read by ``TierManager.stats()``.

The core is dependency-free. ``TierCacheCollector`` / ``render_prometheus`` expose
``TierManager.stats()`` in the Prometheus text format (the optional ``metrics``
extra, ``prometheus-client``), and ``StatsServer`` serves both JSON and that text
on a loopback port so ``tiercache stats`` (or a Prometheus scrape) can read a
running manager.
"""

from __future__ import annotations

import bisect
import http.server
import json
import math
import re
import threading
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from tiercache.units import MS_PER_SECOND

LATENCY_BUCKETS_MS: tuple[float, ...] = tuple(round(0.01 * 2**i, 4) for i in range(22))
"""Upper bounds from 10 µs doubling to about 21 s."""
LOOPBACK = "127.0.0.1"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class LatencyHistogram:
    """Fixed log-spaced buckets: cheap to record, percentiles good to a factor of two."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_MS) + 1))
    total_ms: float = 0.0
    count: int = 0

    def record(self, milliseconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_MS, milliseconds)] += 1
        self.total_ms += milliseconds
        self.count += 1

    def percentile(self, fraction: float) -> float:
        """Upper bound of the bucket holding the ``fraction`` quantile (ms)."""
        if not self.count:
            return 0.0
        rank = math.ceil(fraction * self.count)
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return LATENCY_BUCKETS_MS[index] if index < len(LATENCY_BUCKETS_MS) else math.inf
        return math.inf

    def summary(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean_ms": self.total_ms / self.count if self.count else 0.0,
            "p50_ms": self.percentile(0.5),
            "p99_ms": self.percentile(0.99),
        }


class Metrics:
    """``counter[tier][name]`` and ``latency[tier][operation]``, safe to write and read from any thread.

    The engine's thread and the background loop both count; ``stats()`` reads at
    any time. One lock of its own (never held while calling out) keeps every
    increment and makes a snapshot consistent.
    """

    def __init__(self) -> None:
        self.counters: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.latency: dict[str, dict[str, LatencyHistogram]] = defaultdict(lambda: defaultdict(LatencyHistogram))
        self._lock = threading.Lock()

    def add(self, tier: str, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[tier][name] += amount

    def observe(self, tier: str, operation: str, milliseconds: float) -> None:
        with self._lock:
            self.latency[tier][operation].record(milliseconds)

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            tiers = set(self.counters) | set(self.latency)
            return {
                tier: {
                    **dict(self.counters.get(tier, {})),
                    **{f"latency_{op}": h.summary() for op, h in self.latency.get(tier, {}).items()},
                }
                for tier in sorted(tiers)
            }

    def histograms(self) -> list[tuple[str, str, list[int], int, float]]:
        """(tier, operation, bucket counts, count, total ms) of every histogram, copied under the lock."""
        with self._lock:
            return [
                (tier, operation, list(h.counts), h.count, h.total_ms)
                for tier, operations in sorted(self.latency.items())
                for operation, h in sorted(operations.items())
            ]


GAUGE_FIELDS = frozenset(
    {
        "capacity_blocks",
        "cached_blocks",
        "free_blocks",
        "evictable_blocks",
        "breaker_state",
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


class StatsServer:
    """Serves a running manager's stats on a loopback port, for ``tiercache stats`` and Prometheus.

    ``GET /stats`` answers ``stats()`` as JSON, ``GET /metrics`` the Prometheus
    text. It binds 127.0.0.1 only (the numbers are not secret, but a cache should
    not open a port to the network by default); port 0 picks a free one. Runs on
    a daemon thread; each request takes the manager's lock briefly through ``stats``.
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]], metrics: Metrics | None = None, port: int = 0) -> None:
        self._stats = stats
        self._metrics = metrics
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = self.path.split("?", 1)[0]
                if route == "/stats":
                    body, kind = json.dumps(server._stats(), default=str).encode(), "application/json"
                elif route == "/metrics":
                    body, kind = render_prometheus(server._stats(), server._metrics).encode(), PROMETHEUS_CONTENT_TYPE
                else:
                    self.send_error(HTTPStatus.NOT_FOUND, "try /stats or /metrics")
                    return
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tiercache-stats", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StatsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port (safe whether or not it was started)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> StatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def fetch_stats(url: str, timeout: float = 2.0) -> dict[str, Any]:
    """``GET {url}/stats`` from a ``StatsServer`` (raises ``OSError`` when unreachable)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/stats", timeout=timeout) as response:
        return json.loads(response.read())
