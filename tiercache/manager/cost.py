"""Cost-aware tiers: skip a remote fetch that would take longer than recomputing its tokens.

A remote tier is worth reading only while fetching a block is cheaper than the
engine's prefill of the same tokens. Per remote tier this model predicts a
fetch's duration as ``round trip + fixed + bytes * per_byte``:

* the round trip is live: the median time of the tier's last presence checks
  (the lookups' "which of these keys do you hold" calls, made whether or not a
  fetch follows), so a tier that gets slow or fast again shows at the second
  lookup after, with no request waiting on an experiment;
* ``fixed + bytes * per_byte`` is an exponentially forgetting least-squares line
  through what each fetch took beyond the round trip of its time. Its slope
  leans on a prior per-byte cost (``prior_bandwidth_bytes_per_s``) as far as
  the sizes seen cannot tell it: with one fetch size seen, the whole time of a
  fetch is not taken as per-byte (a 16-block load after 1-block fetches of a
  10 ms tier is about 10 ms, not 16 x 10); with sizes that spread, the data
  decide, the more so the less they scatter around their line;
* a stall (a garbage collection or a descheduled thread inside one timed read)
  is outvoted: the estimate is the fit's, or the median of the last three
  fetches (``RecentFetches``) where that is lower, so one slow fetch among
  fast ones changes no verdict (``FETCH_WINDOW`` says the bounds).

``verdict`` answers fetch or bypass for one tier's part of a request. A bypassed
tier's fetches are not observed, so a change that only fetches show (a slower
link, not a longer round trip) would never be seen. Two things find it:

* explorations: every n-th would-be bypass (deterministically, one in flight
  per tier) is ``EXPLORE``: the request recomputes like any bypass, and the
  caller fetches the bypassed blocks in the background, off every request's
  path, and reports that fetch (``exploration_ended``) to the fit;
* staleness: each request that bypassed a tier ages its fit as a fetch would
  (down to ``STALE_FLOOR_WEIGHT``), so the next exploration is weighed against
  evidence as old as it is, not against a past frozen when bypassing began.

Asking and telling are apart: ``verdict`` and ``cut`` only read (a lookup asks
them as often as the engine retries), ``count`` records a verdict the request
went ahead with (once per request, at load), which moves the counters, the
staleness and the exploration schedule.

Pure: no threads, no I/O, no clock; the caller times its fetches, presence
checks and prefills. Not thread-safe: call it under one lock (the manager's).
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.config.cost_options import CostConfig

PRESENCE_CHECK_WINDOW = 3
"""Presence checks whose median is the live round trip: a change shows at the second check after it, and
one check out of line (a scheduling hiccup) changes nothing. Of two checks the lower one counts
(``median_low``): a stall only ever adds time, so a stalled first check does not set the round trip."""
FETCH_WINDOW = 3
"""Recent fetches whose median (the lower one of two) caps the fit's estimate (``RecentFetches``).
By construction: one stall among any three fetches (or two) never raises the estimate above a fast
one; a recovered tier is fetched from again once two of its last three fetches are fast, so after at
most two explorations while it is bypassed, barring a stall in them (one where the fit alone forgets
its past, about ten times slower than recomputing at most); a lasting slow-down raises the median
from its second slow fetch, and the estimate with it once the fit is past recomputing too: at the
second slow fetch for one that takes ``1 / (1 - (1 - smoothing) ** 2)`` times the recompute time
(2.8 at the default) or more, within a few more for a milder one."""
MIN_FIT_WEIGHT = 2.0
"""Observations (decayed) a line needs before its scatter says anything: two points always fit exactly."""
STALE_FLOOR_WEIGHT = 0.1
"""The least weight (in fetches) staleness leaves a fit: a long-bypassed past still counts as a tenth of a
fresh fetch, so one exploration moves the estimate about 93% of the way (a link ten times slower than
recomputing is forgotten in one, a hundred times in two), and its zeros never underflow."""


class Verdict(enum.Enum):
    """What to do with one remote tier's part of a request."""

    FETCH = "fetch"
    """Expected cheaper than recomputing (or one side is still unknown)."""
    EXPLORE = "explore"
    """Expected dearer: recompute, and fetch the blocks in the background so the estimate can notice a
    recovery (no request waits on it)."""
    BYPASS = "bypass"
    """Expected dearer: recompute instead."""


@dataclass
class FetchFit:
    """Exponentially forgetting least squares of seconds against bytes, and bytes per block.

    The slope is the posterior mean under a prior of ``prior_per_byte`` (give or
    take its own size): the sizes' spread and the points' scatter around their line
    decide how far the data move it.
    """

    smoothing: float
    prior_per_byte: float
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    sum_yy: float = 0.0
    blocks: float = 0.0

    def age(self) -> None:
        """Decay the past by ``1 - smoothing`` with nothing added (a request that did not fetch), down to
        ``STALE_FLOOR_WEIGHT``."""
        keep = 1.0 - self.smoothing
        if self.weight * keep < STALE_FLOOR_WEIGHT:
            keep = STALE_FLOOR_WEIGHT / self.weight if self.weight > STALE_FLOOR_WEIGHT else 1.0
        self.weight *= keep
        self.sum_x *= keep
        self.sum_y *= keep
        self.sum_xx *= keep
        self.sum_xy *= keep
        self.sum_yy *= keep
        self.blocks *= keep

    def add(self, blocks: int, nbytes: int, seconds: float) -> None:
        """Fold in one fetch, after decaying the past by ``1 - smoothing``."""
        keep = 1.0 - self.smoothing
        x = float(nbytes)
        self.weight = self.weight * keep + 1.0
        self.sum_x = self.sum_x * keep + x
        self.sum_y = self.sum_y * keep + seconds
        self.sum_xx = self.sum_xx * keep + x * x
        self.sum_xy = self.sum_xy * keep + x * seconds
        self.sum_yy = self.sum_yy * keep + seconds * seconds
        self.blocks = self.blocks * keep + blocks

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per byte), both >= 0."""
        weight = self.weight
        mean_x = self.sum_x / weight
        mean_y = self.sum_y / weight
        var_x = max(self.sum_xx / weight - mean_x * mean_x, 0.0)
        cov = self.sum_xy / weight - mean_x * mean_y
        slope = self.prior_per_byte
        if var_x > 0 and weight > MIN_FIT_WEIGHT:
            var_y = max(self.sum_yy / weight - mean_y * mean_y, 0.0)
            scatter = max(var_y - cov * cov / var_x, 0.0) * weight / (weight - MIN_FIT_WEIGHT)
            prior_strength = scatter / (self.prior_per_byte * self.prior_per_byte)  # noise / prior variance
            slope = (weight * cov + prior_strength * self.prior_per_byte) / (weight * var_x + prior_strength)
        intercept = mean_y - slope * mean_x
        if slope < 0:
            return mean_y, 0.0
        if intercept < 0:  # faster than the slope allows for the fixed part: all of it per byte
            return 0.0, self.sum_xy / self.sum_xx if self.sum_xx else 0.0
        return intercept, slope

    def bytes_of(self, blocks: int, nbytes: int | None = None) -> int:
        """``nbytes`` if known, else ``blocks`` blocks of the mean size seen."""
        if nbytes is None:
            nbytes = round(blocks * self.sum_x / self.blocks) if self.blocks else 0
        return nbytes

    def seconds(self, blocks: int, nbytes: int | None = None) -> float:
        """Expected duration of a fetch of ``blocks`` blocks (``nbytes`` if known, else the mean block size)."""
        fixed, per_byte = self.line()
        return fixed + per_byte * self.bytes_of(blocks, nbytes)


@dataclass
class RecentFetches:
    """The last ``FETCH_WINDOW`` fetches as (bytes, seconds beyond the round trip): the fit's check on a stall.

    Why a median that only lowers the fit's estimate, rather than a median alone or a fit that rejects
    outliers: a pause of the engine's process only ever adds time to a fetch, and the two mistakes cost
    differently. A fetch judged too cheap is timed and corrects the model at once; a tier judged too dear is
    bypassed and seen again only by an exploration (1 in ``1 / explore_fraction`` bypasses). So slow evidence
    needs a second witness among the last three before it moves a verdict, while fast evidence (a recovery)
    counts at once, through the fit as before, and at the latest from the second fast fetch, through this.
    """

    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=FETCH_WINDOW))

    def add(self, nbytes: int, seconds: float) -> None:
        """One fetch of ``nbytes`` took ``seconds`` beyond the round trip (the oldest leaves the window)."""
        self.samples.append((nbytes, seconds))

    def median(self, per_byte: float, nbytes: int) -> float | None:
        """The median (the lower of two) of the recent fetches, each moved to ``nbytes`` along the fitted slope
        ``per_byte``; None before any."""
        if not self.samples:
            return None
        moved = [seconds + per_byte * (nbytes - size) for size, seconds in self.samples]
        return max(statistics.median_low(moved), 0.0)


@dataclass
class TierCost:
    """One remote tier's fit, live round trip and counters."""

    fit: FetchFit
    recent_fetches: RecentFetches = field(default_factory=RecentFetches)
    recent_presence_checks: deque[float] = field(default_factory=lambda: deque(maxlen=PRESENCE_CHECK_WINDOW))
    fetches_planned: int = 0
    bypassed_slower_than_recompute: int = 0
    """Requests that recomputed this tier's part (explorations included)."""
    explored: int = 0
    """Explorations started."""
    since_explore: int = 0
    """Would-be bypasses since the last exploration started (the schedule)."""
    exploring: bool = False
    """An exploration is in flight (reported back by ``exploration_ended``)."""
    observations: int = 0
    presence_checks: int = 0

    @property
    def round_trip_s(self) -> float | None:
        """The median of the recent presence checks, the lower of two (None before any)."""
        return statistics.median_low(self.recent_presence_checks) if self.recent_presence_checks else None

    def fetch_seconds(self, blocks: int, nbytes: int | None = None) -> float:
        """Expected time of a fetch beyond the round trip: the fit's, or the recent fetches' median if lower."""
        nbytes = self.fit.bytes_of(blocks, nbytes)
        fixed, per_byte = self.fit.line()
        fitted = fixed + per_byte * nbytes
        recent = self.recent_fetches.median(per_byte, nbytes)
        return fitted if recent is None else min(fitted, recent)


@dataclass
class CostModel:
    """Per remote tier: expected fetch time against expected recompute time, and the decision."""

    config: CostConfig = field(default_factory=CostConfig)
    _tiers: dict[str, TierCost] = field(default_factory=dict, init=False)
    _prefill_tokens: float = field(default=0.0, init=False)
    _prefill_seconds: float = field(default=0.0, init=False)

    def _tier(self, tier: str) -> TierCost:
        state = self._tiers.get(tier)
        if state is None:
            fit = FetchFit(self.config.smoothing, 1.0 / self.config.prior_bandwidth_bytes_per_s)
            state = self._tiers[tier] = TierCost(fit)
        return state

    def observe_fetch(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        """A fetch of ``blocks`` blocks (``nbytes`` bytes) from ``tier`` took ``seconds`` (hit or miss alike)."""
        if blocks <= 0 or seconds < 0:
            return
        state = self._tier(tier)
        beyond = max(seconds - (state.round_trip_s or 0.0), 0.0)
        state.fit.add(blocks, nbytes, beyond)
        state.recent_fetches.add(nbytes, beyond)
        state.observations += 1

    def observe_presence_check(self, tier: str, seconds: float) -> None:
        """A presence check of ``tier`` (asking which keys it holds) took ``seconds``: the tier's live round
        trip."""
        if seconds < 0:
            return
        state = self._tier(tier)
        state.recent_presence_checks.append(seconds)
        state.presence_checks += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled ``tokens`` tokens in ``seconds``; replaces the configured rate from now on."""
        if tokens <= 0 or seconds <= 0:
            return
        keep = 1.0 - self.config.smoothing
        self._prefill_tokens = self._prefill_tokens * keep + tokens
        self._prefill_seconds = self._prefill_seconds * keep + seconds

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The engine's prefill rate: smoothed observations, else the configured one, else None."""
        if self._prefill_seconds > 0:
            return self._prefill_tokens / self._prefill_seconds
        return self.config.prefill_tokens_per_s

    def expected_fetch_seconds(self, tier: str, blocks: int, nbytes: int | None = None) -> float | None:
        """Predicted duration of a fetch of ``blocks`` blocks from ``tier`` (None before any fetch is observed)."""
        state = self._tiers.get(tier)
        if state is None or not state.observations:
            return None
        return (state.round_trip_s or 0.0) + state.fetch_seconds(blocks, nbytes)

    def expected_recompute_seconds(self, tokens: int) -> float | None:
        """Predicted prefill time of ``tokens`` tokens (None while the rate is unknown)."""
        rate = self.prefill_tokens_per_s
        return None if rate is None else tokens / rate

    def verdict(self, tier: str, blocks: int, tokens: int, nbytes: int | None = None) -> Verdict | None:
        """Fetch, explore or bypass these ``blocks`` (``tokens`` tokens) from ``tier``; reads only.

        None when there is nothing to weigh (the model is disabled, or no blocks);
        ``FETCH`` while either side is still unknown.
        """
        if not self.config.enabled or blocks <= 0:
            return None
        fetch = self.expected_fetch_seconds(tier, blocks, nbytes)
        recompute = self.expected_recompute_seconds(tokens)
        if fetch is None or recompute is None or fetch <= self.config.margin * recompute:
            return Verdict.FETCH
        state = self._tiers[tier]
        due = not state.exploring and state.since_explore + 1 >= self._explore_every()
        return Verdict.EXPLORE if due else Verdict.BYPASS

    def count(self, tier: str, verdict: Verdict | None) -> Verdict | None:
        """A request went ahead with ``verdict`` on ``tier``: the counters, the staleness and the exploration
        schedule move. Returns the verdict counted: ``EXPLORE`` (the caller starts the exploration and
        reports it with ``exploration_ended``) becomes ``BYPASS`` while another is in flight."""
        if verdict is None:
            return None
        state = self._tier(tier)
        if verdict is Verdict.FETCH:
            state.fetches_planned += 1
            return verdict
        state.bypassed_slower_than_recompute += 1
        state.fit.age()
        if verdict is Verdict.EXPLORE and not state.exploring:
            state.explored += 1
            state.exploring = True
            state.since_explore = 0
            return verdict
        state.since_explore += 1
        return Verdict.BYPASS

    def exploration_ended(self, tier: str, blocks: int = 0, nbytes: int = 0, seconds: float | None = None) -> None:
        """The exploration ``count`` started on ``tier`` is over; it fetched ``blocks`` (``nbytes``) in
        ``seconds`` (None: the tier was never asked, or it failed before saying anything)."""
        self._tier(tier).exploring = False
        if seconds is not None:
            self.observe_fetch(tier, blocks, nbytes, seconds)

    def cut(
        self, runs: Sequence[tuple[str | None, int]], block_size: int
    ) -> tuple[int, list[tuple[str, Verdict | None]]]:
        """How many blocks of a lookup's prefix to use, and the verdict on each tier weighed; reads only.

        ``runs`` is the prefix in order as (tier serving it, blocks), tier None for blocks already
        local (GPU, CPU). Keys chain, so skipping a tier's blocks loses every block after its first
        one: a tier is weighed against recomputing the tokens from there to the end of what is still
        used, with all its blocks in that span as one fetch. Tiers are weighed in the order they first
        appear; the prefix stops before the first one not worth fetching (bypassed or explored).
        """
        starts: dict[str, int] = {}
        position = 0
        for tier, blocks in runs:
            if tier is not None:
                starts.setdefault(tier, position)
            position += blocks
        usable = position
        verdicts: list[tuple[str, Verdict | None]] = []
        for tier, start in starts.items():  # insertion order: first appearance
            if start >= usable:
                break
            verdict = self.verdict(tier, _blocks_before(runs, tier, usable), (usable - start) * block_size)
            verdicts.append((tier, verdict))
            if verdict is Verdict.BYPASS or verdict is Verdict.EXPLORE:
                usable = start
        return usable, verdicts

    def _explore_every(self) -> int:
        return max(1, round(1 / self.config.explore_fraction))

    def stats(self) -> dict[str, object]:
        """The prefill rate and, per tier, the live round trip, the fitted latency beyond it and throughput,
        and the decision counters."""
        tiers: dict[str, dict[str, float | int | None]] = {}
        for name, state in self._tiers.items():
            latency, per_byte = state.fit.line() if state.observations else (None, None)
            tiers[name] = {
                "round_trip_s": state.round_trip_s,
                "latency_s": latency,
                "throughput_bytes_per_s": (1.0 / per_byte) if per_byte else None,
                "observations": state.observations,
                "fetches_planned": state.fetches_planned,
                "bypassed_slower_than_recompute": state.bypassed_slower_than_recompute,
                "explored": state.explored,
                "explorations_in_flight": int(state.exploring),
            }
        return {"enabled": self.config.enabled, "prefill_tokens_per_s": self.prefill_tokens_per_s, "tiers": tiers}


def _blocks_before(runs: Sequence[tuple[str | None, int]], tier: str, limit: int) -> int:
    """Blocks served by ``tier`` among the first ``limit`` blocks of ``runs``."""
    count = position = 0
    for serving, blocks in runs:
        if position >= limit:
            break
        if serving == tier:
            count += min(blocks, limit - position)
        position += blocks
    return count
