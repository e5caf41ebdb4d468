"""Counters and latency histograms per tier, read by ``TierManager.stats()`` (dependency-free, thread-safe).

``prometheus`` exposes them in the Prometheus text format and ``stats_server``
serves them on a loopback port.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

LATENCY_BUCKETS_MS: tuple[float, ...] = tuple(round(0.01 * 2**i, 4) for i in range(22))
"""Upper bounds from 10 µs doubling to about 21 s."""


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

    def add_each(self, increments: Iterable[tuple[str, str, int]]) -> None:
        """Several ``add``s, (tier, name, amount) each, under one taking of the lock (a hit's path counts many)."""
        with self._lock:
            counters = self.counters
            for tier, name, amount in increments:
                counters[tier][name] += amount

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


