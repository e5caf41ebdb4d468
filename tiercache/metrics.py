"""Counters and latency histograms per tier, read by ``TierManager.stats()``.

Kept dependency-free; an optional Prometheus exposition reads the same numbers.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
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
    """``counter[tier][name]`` and ``latency[tier][operation]``."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.latency: dict[str, dict[str, LatencyHistogram]] = defaultdict(lambda: defaultdict(LatencyHistogram))

    def add(self, tier: str, name: str, amount: int = 1) -> None:
        self.counters[tier][name] += amount

    def observe(self, tier: str, operation: str, milliseconds: float) -> None:
        self.latency[tier][operation].record(milliseconds)

    def snapshot(self) -> dict[str, dict[str, object]]:
        tiers = set(self.counters) | set(self.latency)
        return {
            tier: {
                **dict(self.counters.get(tier, {})),
                **{f"latency_{op}": h.summary() for op, h in self.latency.get(tier, {}).items()},
            }
            for tier in sorted(tiers)
        }
