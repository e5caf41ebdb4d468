"""The transfer queue: one lane per remote tier, between the pinned-CPU slots and the store.

A lane bounds the operations in flight to its tier (``PriorityLimiter``: loads
before stores, a slot kept for loads), turns any exception or wrong-sized answer
into failures of the keys involved, times every call, and keeps the tier's
breaker (the one breaker a read passes on its way to a single server), fed by
what the engine feels: a lookup or a read that passes its deadline counts as a
failure exactly like a refused connection (a call during which the tier said
``server_failed``) or an exception. The deadline bounds what the engine waits
for whatever the tier's sockets do: the lane stops waiting and the late call
runs out by itself; a late read hands its call to the caller, who keeps the
read's buffers reserved until it is done. The tier sets the breaker
(``RemoteTier.breaker_settings``; by default ``LANE_BREAKER_FAILURES`` failures
in a row open it, for ``LANE_BACKOFF_SECONDS`` doubling to
``LANE_BACKOFF_MAX_SECONDS``); while open the lane answers misses at once, and
after the back-off one trial call asks the tier again.

A lane reads one tier; ``reads`` walks the lanes of a read fastest first, and
``presence`` remembers the lookups in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tiercache.common.breaker import CircuitBreaker
from tiercache.common.units import MS_PER_SECOND
from tiercache.movement.base import LinkObserver
from tiercache.movement.limiter import Priority, PriorityLimiter
from tiercache.telemetry.counters import Metrics
from tiercache.tiers.base import BreakerSettings, CallReport, Presence, RemoteTier, report_calls_into

T = TypeVar("T")

log = logging.getLogger(__name__)

LANE_BREAKER_FAILURES = 3
"""Consecutive failed or late operations after which a lane stops asking its tier for a while."""
LANE_BACKOFF_SECONDS = 0.5
"""First back-off of an open lane; it doubles per failed trial call up to ``LANE_BACKOFF_MAX_SECONDS``."""
LANE_BACKOFF_MAX_SECONDS = 30.0
LANE_BREAKER = BreakerSettings(LANE_BREAKER_FAILURES, LANE_BACKOFF_SECONDS, LANE_BACKOFF_MAX_SECONDS)
"""A lane's breaker where its tier names no settings of its own."""
LOAD_DEADLINE_FACTOR = 20
"""A read may take this many remote-lookup timeouts before it counts as late (and fails)."""


@dataclass(frozen=True)
class LaneRead:
    """One lane's answer to a read."""

    oks: list[bool] | None
    """Per key, whether its value arrived (validated); None when the call failed as a whole (deadline, open
    breaker, exception, a wrong-sized answer): the tier told nothing about any key."""
    asked_s: float | None
    """Seconds from the moment the tier was asked (after the lane's queue) to its answer or the deadline; None
    when it was never asked."""
    waited_s: float
    """Seconds the caller waited, the lane's queue included."""
    timed_out: bool
    """The call ran to its deadline."""


class Lane:
    """One remote tier with its limiter, breaker and counters."""

    def __init__(
        self, index: int, tier: RemoteTier, concurrency: int, metrics: Metrics, lookup_timeout_s: float
    ) -> None:
        self.index = index
        self.tier = tier
        self.name = tier.name
        self.limiter = PriorityLimiter(concurrency)
        self.metrics = metrics
        self.lookup_timeout_s = lookup_timeout_s
        settings = tier.breaker_settings() or LANE_BREAKER
        self.breaker = CircuitBreaker(settings.failures, settings.backoff_s, settings.backoff_max_s)
        """The tier's breaker: every call the engine makes passes it."""
        self.link: LinkObserver | None = None
        """Told how long every answered ``contains`` took (the cost model's live round trip)."""

    async def _call(
        self,
        priority: Priority,
        operation: Callable[[], Awaitable[list[T]]],
        count: int,
        deadline_s: float | None,
        on_late: Callable[[asyncio.Future[Any]], None] | None = None,
    ) -> list[T] | None:
        """Run a tier operation inside the lane's limit and deadline; None when it failed as a whole.

        At the deadline the lane stops waiting, whatever the tier's sockets or threads
        do: the call fails now and, once the tier was asked, goes on by itself (never
        cancelled: a tier's cancel may return before its threads let go of the
        caller's buffers). ``on_late`` gets that call; it is done once the tier no
        longer touches what it was given. A call still waiting for a slot is dropped.
        A call during which the tier said its server failed counts against the
        breaker but keeps its per-key results.
        """
        if not self.breaker.allow():
            self.metrics.add(self.name, "lane_open_skips")
            return None
        started = time.perf_counter()
        asked = False
        report = CallReport()

        def ask() -> Awaitable[list[T]]:
            nonlocal asked
            asked = True
            report_calls_into(report)  # in the call's own task: what the tier says of its server lands here
            return operation()

        call = asyncio.ensure_future(self.limiter.run(priority, ask))
        try:
            done, _ = await asyncio.wait({call}, timeout=deadline_s)
        except asyncio.CancelledError:
            call.cancel()
            self.breaker.abandon()
            raise
        if not done:
            if not asked:  # still waiting for a slot: the tier was never asked, nothing of the caller's is in use
                call.cancel()
                if priority is Priority.EXPLORE:  # starved by the lane's other work: says nothing of the tier
                    self.metrics.add(self.name, "explorations_starved")
                    self.breaker.abandon()
                    return None
            self.metrics.add(self.name, "deadline_misses")
            self.breaker.failure()
            if asked:
                self._leave_late(call, on_late)
            return None
        try:
            result = call.result()
        except Exception:
            log.exception("tier %s raised; counting its keys as failed", self.name)
            self.metrics.add(self.name, "exceptions")
            self.breaker.failure()
            return None
        if len(result) != count:
            log.error("tier %s returned %d results for %d keys", self.name, len(result), count)
            self.breaker.failure()
            return None
        if report.server_failed is not None:  # the per-key results stand (a valid prefix is still served)
            self.metrics.add(self.name, "server_failures")
            self.breaker.failure()
            return result
        self.breaker.success()
        self.metrics.observe(self.name, "call", (time.perf_counter() - started) * MS_PER_SECOND)
        return result

    def _leave_late(
        self, call: asyncio.Future[Any], on_late: Callable[[asyncio.Future[Any]], None] | None
    ) -> None:
        """Let a call past its deadline run out on its own (``late_calls_in_flight`` until it has)."""
        self.metrics.add(self.name, "late_calls_in_flight")

        def ended(_: asyncio.Future[Any]) -> None:
            self.metrics.add(self.name, "late_calls_in_flight", -1)
            if not call.cancelled() and call.exception() is not None:
                log.warning("tier %s: a call past its deadline raised: %r", self.name, call.exception())

        call.add_done_callback(ended)
        if on_late is not None:
            on_late(call)

    @property
    def read_deadline_s(self) -> float:
        """How long a read (a load's or an exploration's) may take before the lane gives up on it."""
        return self.lookup_timeout_s * LOAD_DEADLINE_FACTOR

    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        """Per key, whether the tier holds it; ``UNKNOWN`` where the lane or the tier could not tell."""
        started = time.perf_counter()
        found = await self._call(Priority.LOAD, lambda: self.tier.contains(keys), len(keys), self.lookup_timeout_s)
        if found is None:
            return [Presence.UNKNOWN] * len(keys)
        if self.link is not None:
            self.link.presence_checked(self.name, time.perf_counter() - started)
        return [answer if isinstance(answer, Presence) else Presence.UNKNOWN for answer in found]

    async def read(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        *,
        force_latest: bool = False,
        priority: Priority = Priority.LOAD,
        on_late: Callable[[asyncio.Future[Any]], None] | None = None,
    ) -> LaneRead:
        """Read ``keys`` into ``views`` (see ``LaneRead``). At the deadline ``on_late`` gets the read, which may
        still write into ``views`` until it is done: keep them reserved till then (an exploration's buffers are
        its own, so it passes none)."""
        _check_lengths(self.name, keys, views=views)
        started = time.perf_counter()
        asked_at: list[float] = []

        def get() -> Awaitable[list[bool]]:
            asked_at.append(time.perf_counter())
            return self.tier.get_into(keys, views, force_latest=force_latest)

        oks = await self._call(priority, get, len(keys), self.read_deadline_s, on_late)
        ended = time.perf_counter()
        self.metrics.observe(self.name, "get", (ended - started) * MS_PER_SECOND)
        asked_s = ended - asked_at[0] if asked_at else None
        return LaneRead(None if oks is None else [bool(ok) for ok in oks], asked_s, ended - started,
                        ended - started >= self.read_deadline_s)

    async def put(
        self, keys: Sequence[bytes], views: Sequence[memoryview], checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        """Store ``views`` under ``keys``, with their ``checksums`` where known (for a tier that takes them)."""
        _check_lengths(self.name, keys, views=views, checksums=checksums)
        started = time.perf_counter()
        tier = self.tier

        def put() -> Awaitable[list[bool]]:
            if checksums is not None and tier.capabilities.takes_checksums:
                self.metrics.add(self.name, "put_checksums_carried", len(checksums) - checksums.count(None))
                return tier.put(keys, views, checksums=checksums)
            return tier.put(keys, views)

        oks = await self._call(Priority.STORE, put, len(keys), None)
        self.metrics.observe(self.name, "put", (time.perf_counter() - started) * MS_PER_SECOND)
        return _booleans(oks, len(keys))


def _check_lengths(lane: str, keys: Sequence[bytes], **per_key: Sequence[Any] | None) -> None:
    """A caller's bug, named at the call: a list that is not one entry per key (a tier would fail it in its I/O
    thread, key by key, far from the cause)."""
    for name, values in per_key.items():
        if values is not None and len(values) != len(keys):
            raise ValueError(f"lane {lane}: {len(keys)} keys but {len(values)} {name}")


def _booleans(results: list[bool] | None, count: int) -> list[bool]:
    """A tier's per-key results as booleans; every key failed when the call failed as a whole."""
    return [False] * count if results is None else [bool(ok) for ok in results]


