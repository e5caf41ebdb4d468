"""Metrics: histograms, snapshots, Prometheus exposition of ``stats()``, the loopback stats server."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.telemetry.counters import LATENCY_BUCKETS_MS, LatencyHistogram, Metrics
from tiercache.telemetry.prometheus import render_prometheus
from tiercache.telemetry.stats_server import StatsServer, fetch_stats

FAKE_STATS = {
    "tiers": {
        "gpu": {"capacity_blocks": 8, "cached_blocks": 3, "hit_blocks": 5, "evictions": 1},
        "redis": {
            "hits": 7,
            "misses": 2,
            "bytes_read": 4096,
            "breaker_state": 2,
            "mode": "cluster",
            "latency_get": {"count": 1, "mean_ms": 0.5, "p50_ms": 0.64, "p99_ms": 0.64},
        },
    },
    "queues": {"pending_stores": 4, "waiting": {"redis": 3}, "active": {"redis": 1}},
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_histogram_percentiles_are_bucket_upper_bounds() -> None:
    histogram = LatencyHistogram()
    for value in (0.005, 0.015, 0.015, 3.0):
        histogram.record(value)
    assert histogram.percentile(0.25) == LATENCY_BUCKETS_MS[0]
    assert histogram.percentile(0.5) == LATENCY_BUCKETS_MS[1]
    assert histogram.percentile(1.0) == 5.12
    assert histogram.summary()["count"] == 4
    assert LatencyHistogram().percentile(0.5) == 0.0


def test_snapshot_merges_counters_and_latency() -> None:
    metrics = Metrics()
    metrics.add("cpu", "hit_blocks", 3)
    metrics.observe("redis", "get", 1.0)
    snapshot = metrics.snapshot()
    assert snapshot["cpu"] == {"hit_blocks": 3}
    assert snapshot["redis"]["latency_get"]["count"] == 1


def test_add_each_counts_as_the_adds_one_by_one_do() -> None:
    increments = [("cpu", "hit_blocks", 3), ("all", "hit_blocks", 4), ("cpu", "hit_blocks", 2), ("gpu", "evictions", 0)]
    together, one_by_one = Metrics(), Metrics()
    together.add_each(increments)
    for tier, name, amount in increments:
        one_by_one.add(tier, name, amount)
    assert together.snapshot() == one_by_one.snapshot() == {
        "all": {"hit_blocks": 4}, "cpu": {"hit_blocks": 5}, "gpu": {"evictions": 0}
    }


def test_prometheus_text_types_and_values() -> None:
    found = samples(render_prometheus(FAKE_STATS))
    assert found[("tiercache_tier_capacity_blocks", (("tier", "gpu"),))] == 8
    assert found[("tiercache_tier_hit_blocks_total", (("tier", "gpu"),))] == 5
    assert found[("tiercache_tier_hits_total", (("tier", "redis"),))] == 7
    assert found[("tiercache_tier_misses_total", (("tier", "redis"),))] == 2
    assert found[("tiercache_tier_bytes_read_total", (("tier", "redis"),))] == 4096
    assert found[("tiercache_tier_breaker_state", (("tier", "redis"),))] == 2
    assert found[("tiercache_tier_mode_info", (("mode", "cluster"), ("tier", "redis")))] == 1
    assert found[("tiercache_tier_latency_get_p99_ms", (("tier", "redis"),))] == 0.64
    assert found[("tiercache_queue_pending_stores", ())] == 4
    assert found[("tiercache_queue_waiting", (("tier", "redis"),))] == 3


def test_prometheus_histograms_from_raw_buckets() -> None:
    metrics = Metrics()
    for value in (0.005, 0.015, 100.0):
        metrics.observe("redis", "get", value)
    found = samples(render_prometheus({"tiers": {}, "queues": {}}, metrics))
    labels = (("operation", "get"), ("tier", "redis"))
    assert found[("tiercache_latency_seconds_count", labels)] == 3
    assert found[("tiercache_latency_seconds_bucket", (("le", "1e-05"), *labels))] == 1
    assert found[("tiercache_latency_seconds_bucket", (("le", "+Inf"), *labels))] == 3
    assert found[("tiercache_latency_seconds_sum", labels)] == pytest.approx(0.10002)


def test_stats_server_serves_json_and_prometheus() -> None:
    with StatsServer(lambda: FAKE_STATS) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert fetch_stats(server.url) == FAKE_STATS
        with urllib.request.urlopen(f"{server.url}/metrics") as response:
            text = response.read().decode()
        assert "tiercache_tier_hits_total" in text
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{server.url}/nothing")


def test_fetch_stats_unreachable_raises_oserror() -> None:
    server = StatsServer(lambda: FAKE_STATS)
    url = server.url
    server.close()
    with pytest.raises(OSError):
        fetch_stats(url, timeout=1.0)
