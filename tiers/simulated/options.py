"""The YAML ``options`` of a ``simulated`` tier."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.common.fields import MAX_TIMEOUT_MS, MAX_TIMEOUT_S, FieldError, number_in_range, queue_size


@dataclass
class SimulatedOptions:
    """The YAML ``options`` of a ``simulated`` tier (times in ms, rates in [0, 1])."""

    latency_ms: float = 0.5
    """Round-trip time added to every request."""
    jitter_ms: float = 0.0
    """Uniform extra latency in [0, jitter_ms]."""
    bandwidth_mb_s: float = 0.0
    """Link bandwidth shared by every client of the store; 0 = unlimited (read live, as ``latency_ms`` is)."""
    error_rate: float = 0.0
    """Probability that one key of a request fails (a miss or a failed write)."""
    timeout_rate: float = 0.0
    """Probability that a whole request hangs for ``timeout_ms`` and then fails."""
    timeout_ms: float = 100.0
    garbage_rate: float = 0.0
    """Probability that a value read back is corrupted (one payload byte flipped)."""
    down_windows_s: list[list[float]] = field(default_factory=list)
    """``[[start, end], ...]`` seconds after ``start()`` during which every request fails."""
    capacity_blocks: int = 0
    """Entries kept (oldest dropped first); 0 = unbounded."""
    max_batch_blocks: int = 16
    """Sub-batch size on the link (fairness granularity)."""
    fair: bool = True
    """Serve clients round-robin per sub-batch; False = whole requests, first come first served."""
    store: str = ""
    """Tiers naming the same store share its data and link; empty = a private store."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("latency_ms", "jitter_ms", "timeout_ms"):
            number_in_range(name, getattr(self, name), 0.0, MAX_TIMEOUT_MS)
        queue_size("max_batch_blocks", self.max_batch_blocks)
        queue_size("capacity_blocks", self.capacity_blocks, low=0)
        for window in self.down_windows_s:
            if not isinstance(window, list) or len(window) != 2:
                raise FieldError("down_windows_s", "[start, end] pairs of seconds", window)
            for bound in window:
                number_in_range("down_windows_s", bound, 0.0, MAX_TIMEOUT_S)
        for name in ("error_rate", "timeout_rate", "garbage_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        for name in ("latency_ms", "jitter_ms", "bandwidth_mb_s", "timeout_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_batch_blocks < 1:
            raise ValueError(f"max_batch_blocks must be >= 1, got {self.max_batch_blocks}")
        for window in self.down_windows_s:
            if len(window) != 2 or window[0] > window[1]:
                raise ValueError(f"down_windows_s entries must be [start, end], got {window}")
