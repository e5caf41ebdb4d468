"""The cost model's settings (the topology's cost section): off by default."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SMOOTHING = 0.2
"""Weight of the newest observation: the fit forgets half its past in about three fetches."""


DEFAULT_EXPLORE_FRACTION = 1 / 8
"""Share of would-be bypasses that also explore (a background fetch of the bypassed blocks), so a tier
whose fetches alone got faster is noticed. No request waits on one; each costs the remote one fetch."""


DEFAULT_MARGIN = 1.0
"""Bypass when expected fetch time exceeds ``margin`` x expected recompute time."""


DEFAULT_PRIOR_BANDWIDTH = 1e9
"""Bytes per second assumed for the per-byte part until fetch sizes that spread tell it: a datacenter
link's order (10 Gb/s is 1.25 GB/s), below what the Redis tier moved against one loopback server here
(2.2-5.0 GB/s for 64 KiB to 4 MiB values: docs/benchmarks.md, "Redis tier"; ``benchmarks/remote.json``)."""


@dataclass
class CostConfig:
    """Settings of the cost model (off by default; the manager's YAML section maps onto it)."""

    enabled: bool = False
    prefill_tokens_per_s: float | None = None
    """The engine's prefill rate before it reports any (``observe_prefill``); None: unknown, never bypass."""
    smoothing: float = DEFAULT_SMOOTHING
    explore_fraction: float = DEFAULT_EXPLORE_FRACTION
    margin: float = DEFAULT_MARGIN
    prior_bandwidth_bytes_per_s: float = DEFAULT_PRIOR_BANDWIDTH

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s: expected a number > 0, got {self.prefill_tokens_per_s!r}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing: expected a number in (0, 1], got {self.smoothing!r}")
        if not 0 < self.explore_fraction <= 1:
            raise ValueError(f"explore_fraction: expected a number in (0, 1], got {self.explore_fraction!r}")
        if not self.margin > 0:
            raise ValueError(f"margin: expected a number > 0, got {self.margin!r}")
        if not self.prior_bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"prior_bandwidth_bytes_per_s: expected a number > 0, got {self.prior_bandwidth_bytes_per_s!r}"
            )
