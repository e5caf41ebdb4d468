"""A circuit breaker with exponential back-off, for any tier that talks to a server.

After ``failure_threshold`` consecutive failures the breaker opens: callers are
told not to try (their blocks are misses at once instead of each waiting for a
timeout against a dead server). After a back-off it lets exactly one trial
call through (half-open); a success closes it, a failure re-opens it with the
back-off multiplied, up to a ceiling, so a server that stays down is tried
less and less often and one that comes back is used again without a restart.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable

BACKOFF_MULTIPLIER = 2.0
"""Each failed trial call multiplies the back-off by this."""
JITTER_FRACTION = 0.1
"""Back-offs are spread by up to +-10% so clients of one server do not retry in lockstep."""


class BreakerState(enum.IntEnum):
    """Numeric so that ``stats()`` can export it as a gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Closed -> open after N consecutive failures -> one trial call after a back-off -> closed.

    Not thread-safe: use it from one event loop. ``allow()`` before an attempt,
    then exactly one of ``success()`` / ``failure()`` / ``abandon()`` for every
    allowed attempt.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if failure_threshold < 1 or backoff_s <= 0 or backoff_max_s < backoff_s:
            raise ValueError("need failure_threshold >= 1 and 0 < backoff_s <= backoff_max_s")
        self.failure_threshold = failure_threshold
        self.base_backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._rng = rng or random.Random()
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.backoff_s = backoff_s
        self.retry_at = 0.0
        self.opened = 0
        """How many times it has opened (a counter for stats)."""
        self.rejected = 0
        """How many attempts it refused."""
        self._trial_in_flight = False

    def allow(self) -> bool:
        """Whether to attempt now; in half-open state only one trial call at a time."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() >= self.retry_at:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        self.rejected += 1
        return False

    def success(self) -> None:
        """The attempt reached the server and got an answer."""
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.backoff_s = self.base_backoff_s
        self._trial_in_flight = False

    def failure(self) -> None:
        """The attempt could not reach the server (refused, reset, timed out)."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self.backoff_s = min(self.backoff_s * BACKOFF_MULTIPLIER, self.backoff_max_s)
            self._open()
        elif self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold:
            self._open()
        self._trial_in_flight = False

    def abandon(self) -> None:
        """The allowed attempt was cancelled before it said anything about the server."""
        self._trial_in_flight = False

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opened += 1
        jitter = 1.0 + self._rng.uniform(-JITTER_FRACTION, JITTER_FRACTION)
        self.retry_at = self._clock() + self.backoff_s * jitter
