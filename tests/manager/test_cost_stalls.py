"""One pause does not fool the cost model: a stalled fetch or presence check among fast ones changes no
verdict.

Step by step against brute-force references (the forgetting mean of one fetch size, and
``statistics.median_low`` of the last three), then end to end through a ``TierManager`` over the
simulated remote, whose ``stall`` makes a real read or presence check take longer (as a garbage collection in a
timed call does): one stall leaves the remote serving, a lasting one is bypassed within two requests,
and a recovery is fetched from again within two explorations.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pytest
import torch
from support.manager_helpers import block_kv, read_block, seed_remote, topology, until

from tiercache.config.cost_options import CostConfig
from tiercache.manager.cost import FETCH_WINDOW, CostModel, RecentFetches, Verdict
from tiercache.manager.tier_manager import TierManager

TIER = "remote"
BLOCK_TOKENS = 16
BLOCK_BYTES = 64 * 1024
LOAD_BLOCKS = 32
PREFILL_TOKENS_PER_S = 50_000.0
"""A load's 512 tokens recompute in 10.24 ms."""
RECOMPUTE_S = LOAD_BLOCKS * BLOCK_TOKENS / PREFILL_TOKENS_PER_S
FAST_S = (0.0005, 0.0006, 0.0004)
"""A 0.5 ms remote's fetches, cycled (a little jitter)."""
STALL_S = 0.076
"""The issue's garbage-collection pause inside one timed read."""
SMOOTHING = CostConfig().smoothing


def model(**options: float) -> CostModel:
    return CostModel(CostConfig(enabled=True, prefill_tokens_per_s=PREFILL_TOKENS_PER_S, **options))


def fit_reference(seconds: list[float]) -> float:
    """The forgetting mean of fetches of one size (newest weight 1, each older one ``1 - smoothing`` less)."""
    weights = [(1 - SMOOTHING) ** age for age in range(len(seconds))][::-1]
    return sum(w * s for w, s in zip(weights, seconds, strict=True)) / sum(weights)


def reference(seconds: list[float]) -> float:
    """The expected fetch: the fit's, or the median (lower of two) of the last three if lower."""
    return min(fit_reference(seconds), statistics.median_low(seconds[-3:]))


def ask(cost: CostModel) -> Verdict | None:
    """One request's verdict on the tier, counted (as a load counts it)."""
    return cost.count(TIER, cost.verdict(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS))


def fetch(cost: CostModel, seconds: float) -> None:
    cost.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, seconds)


def test_the_window_is_three_fetches() -> None:
    assert FETCH_WINDOW == 3, "the bounds below (one stall in three, two to flip) are stated for three"


@pytest.mark.parametrize("position", [1, 2, 10])
def test_one_stall_among_fast_fetches_changes_no_verdict(position: int) -> None:
    """A 76 ms stall as the ``position``-th fetch of a 0.5 ms remote: every request still fetches, though the
    fit alone would have bypassed the remote (the issue)."""
    cost, seen = model(), []
    times = [FAST_S[i % len(FAST_S)] for i in range(position)] + [STALL_S] + list(FAST_S) * 3
    for seconds in times:
        assert ask(cost) is Verdict.FETCH, f"after {seen}"
        fetch(cost, seconds)
        seen.append(seconds)
        assert cost.expected_fetch_seconds(TIER, LOAD_BLOCKS) == pytest.approx(reference(seen))
        if seconds == STALL_S:
            assert fit_reference(seen) > RECOMPUTE_S, "the fit alone is fooled by the stall"
    assert ask(cost) is Verdict.FETCH
    assert cost.stats()["tiers"][TIER]["bypassed_slower_than_recompute"] == 0


@pytest.mark.parametrize("slowness", [1.5, 2.0, 3.0, 10.0, 100.0])
def test_a_lasting_slow_down_is_bypassed_as_soon_as_the_reference_says(slowness: float) -> None:
    """Fetches ``slowness`` times the recompute time from now on: the verdict flips at the request the brute
    force says, at the second slow fetch for 1 / (1 - (1 - smoothing)^2) = 2.8 times or more."""
    cost, seen = model(), []
    for seconds in FAST_S * 4:
        fetch(cost, seconds)
        seen.append(seconds)
    slow = slowness * RECOMPUTE_S
    flipped = None
    for request in range(20):
        expected_bypass = reference(seen) > RECOMPUTE_S
        verdict = ask(cost)
        assert (verdict is not Verdict.FETCH) == expected_bypass, f"request {request}: {seen}"
        if expected_bypass:
            flipped = request
            break
        fetch(cost, slow)
        seen.append(slow)
    assert flipped is not None and flipped >= 2, "one slow fetch is a stall, not yet a slow-down"
    if slowness >= 1 / (1 - (1 - SMOOTHING) ** 2):
        assert flipped == 2


def requests_until_fetched(cost: CostModel, seconds: float, seen: list[float]) -> tuple[int, int]:
    """Requests against a tier whose fetches (and explorations) take ``seconds``, until one fetches: returns
    (bypassing requests, explorations among them); each exploration ends before the next request. None bypasses
    while the median (lower of two) of the last three fetches in ``seen`` is under the recompute time."""
    bypassed = explorations = 0
    while (verdict := ask(cost)) is not Verdict.FETCH:
        assert statistics.median_low(seen[-3:]) > RECOMPUTE_S, f"bypassed though the window says fast: {seen}"
        bypassed += 1
        assert bypassed < 10_000, "never fetched again"
        if verdict is Verdict.EXPLORE:
            explorations += 1
            cost.exploration_ended(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, seconds)
            seen.append(seconds)
    return bypassed, explorations


@pytest.mark.parametrize("slowness", [3.0, 30.0, 1000.0, 1e6])
def test_a_recovered_tier_is_fetched_from_again_within_two_explorations(slowness: float) -> None:
    """However slow the tier was and however long it was bypassed, two fast explorations bring the median of
    the last three (computed here) under the recompute time, and the model fetches no later than that."""
    cost, seen = model(), []
    for seconds in FAST_S * 4:
        fetch(cost, seconds)
        seen.append(seconds)
    slow = slowness * RECOMPUTE_S
    for _ in range(2):
        assert ask(cost) is Verdict.FETCH
        fetch(cost, slow)
        seen.append(slow)
    for _ in range(40):  # bypassed, exploring now and then (slow)
        if ask(cost) is Verdict.EXPLORE:
            cost.exploration_ended(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, slow)
            seen.append(slow)
    bypassed, explorations = requests_until_fetched(cost, FAST_S[0], seen)
    assert 1 <= explorations <= 2
    explore_every = round(1 / CostConfig().explore_fraction)
    assert bypassed <= 2 * explore_every
    if slowness >= 1000:
        assert explorations == 2, "the fit alone cannot forget this in one exploration: the window does in two"


def test_a_stalled_presence_check_sets_no_round_trip() -> None:
    """The round trip is the median (the lower of two) of the last three presence checks: a stalled first one is
    outvoted by the second, one among fast ones changes nothing, two slow ones in a row are a slow round trip."""
    cost, checks, verdicts = model(), [], []
    fetch(cost, FAST_S[0])
    for seconds in [STALL_S, *FAST_S, STALL_S, *FAST_S, STALL_S, STALL_S]:
        cost.observe_presence_check(TIER, seconds)
        checks.append(seconds)
        round_trip = statistics.median_low(checks[-3:])
        assert cost.stats()["tiers"][TIER]["round_trip_s"] == round_trip
        verdict = cost.verdict(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)
        assert (verdict is Verdict.FETCH) == (round_trip + FAST_S[0] <= RECOMPUTE_S), checks
        verdicts.append(verdict is Verdict.FETCH)
    assert verdicts == [False] + [True] * 8 + [False], "only a lone first check, or two stalls in a row, bypass"


def test_recent_fetches_move_each_fetch_to_the_asked_size_along_the_slope() -> None:
    """Mixed sizes: each fetch is moved along the slope to the asked size, then the median (lower of two)."""
    recent, per_byte = RecentFetches(), 1e-9
    assert recent.median(per_byte, BLOCK_BYTES) is None
    fetches = [(BLOCK_BYTES, 0.004), (16 * BLOCK_BYTES, 0.003), (4 * BLOCK_BYTES, 0.9), (2 * BLOCK_BYTES, 0.002)]
    for count, (nbytes, seconds) in enumerate(fetches, start=1):
        recent.add(nbytes, seconds)
        for asked in (BLOCK_BYTES, 8 * BLOCK_BYTES, 64 * BLOCK_BYTES):
            moved = [s + per_byte * (asked - n) for n, s in fetches[max(0, count - 3) : count]]
            assert recent.median(per_byte, asked) == pytest.approx(max(statistics.median_low(moved), 0.0))
    recent.add(64 * BLOCK_BYTES, 0.0)
    assert recent.median(1.0, 0) == 0.0, "moved below zero: no fetch takes less than nothing"


# ---- end to end: a TierManager over the simulated remote ---------------------------------------------------
LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32", "block_size": 2}
"""2 KiB blocks."""
BLOCK = LAYOUT["block_size"]
PROMPT_BLOCKS = 4
RECOMPUTE_TOKENS_PER_S = 80.0
"""A prompt (8 tokens) recomputes in 100 ms; the simulated remote (no latency) fetches it in about 1."""
PAUSE_MS = 500.0
"""A stall, or a lasting slow-down, of five times the recompute time (at least 2.8: two slow fetches flip)."""
EXPLORE_EVERY = 4
RECOVERY_BOUND = 2 * EXPLORE_EVERY
"""Requests after the remote recovers that may still recompute: two explorations, each due within
``EXPLORE_EVERY`` bypassing requests; the request after the second fetches."""
WAIT_S = 20.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


def engine() -> TierManager:
    """GPU, CPU and a simulated remote that requests only read (written by ``seed``)."""
    remote = {"type": "simulated", "name": TIER, "write_policy": "write_through_selective",
              "admit_after_hits": 1_000_000, "options": {"latency_ms": 0}}
    cost = {"enabled": True, "prefill_tokens_per_s": RECOMPUTE_TOKENS_PER_S, "explore_fraction": 1 / EXPLORE_EVERY}
    queues = {"remote_lookup_timeout_ms": 4 * PAUSE_MS}  # a stalled presence check is answered, not timed out
    return TierManager(topology(16, 16, layout=LAYOUT, remotes=[remote], cost=cost, queues=queues))


def seed(manager: TierManager, prompts: int) -> list[np.ndarray]:
    """Distinct prompts held by the remote only (so every request starts from it)."""
    return seed_remote(manager, prompts, PROMPT_BLOCKS)


def remote_stats(manager: TierManager) -> dict[str, Any]:
    return manager.stats()["tiers"][TIER]


def request(manager: TierManager, tokens: np.ndarray) -> int:
    """One request: look up, load, check the KV served; returns the remote blocks it was served, once no
    exploration is in flight."""
    hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
    fresh = manager.allocate(PROMPT_BLOCKS - len(hit.gpu_block_ids))
    served = manager.load(hit, fresh[: hit.num_lower_blocks]).result(WAIT_S) // BLOCK
    for position, block in enumerate(fresh[:served]):
        assert torch.equal(read_block(manager, block), block_kv(manager, hit.keys[position])), "wrong KV served"
    manager.release(hit.gpu_block_ids + fresh)
    until(lambda: not remote_stats(manager).get("explorations_in_flight", 0), WAIT_S)
    return served


@pytest.mark.parametrize("kind", ["get", "contains"])
def test_one_stalled_read_or_presence_check_leaves_the_remote_serving(kind: str) -> None:
    """A 500 ms pause in one read (after three fast ones) or in the very first presence check: every request is served
    by the remote, none bypasses it."""
    with engine() as manager:
        sim, prompts = manager.parts.remotes[0], iter(seed(manager, 10))
        if kind == "contains":
            sim.stall("contains", PAUSE_MS)
        served = [request(manager, next(prompts)) for _ in range(3)]
        if kind == "get":
            sim.stall("get", PAUSE_MS)
            served.append(request(manager, next(prompts)))
            fitted = remote_stats(manager)["latency_s"]
            assert fitted > PROMPT_BLOCKS * BLOCK / RECOMPUTE_TOKENS_PER_S, "the fit alone would bypass"
        served += [request(manager, next(prompts)) for _ in range(5)]
        assert served == [PROMPT_BLOCKS] * len(served)
        stats = remote_stats(manager)
        assert stats["bypassed_slower_than_recompute"] == 0 and stats["explored"] == 0
        assert sim.calls[kind] >= len(served), "the stall was a real call of that kind"


def test_a_lasting_slow_down_is_bypassed_within_two_requests_and_a_recovery_used_within_two_explorations() -> None:
    with engine() as manager:
        sim, prompts = manager.parts.remotes[0], iter(seed(manager, 40))
        assert [request(manager, next(prompts)) for _ in range(3)] == [PROMPT_BLOCKS] * 3

        sim.stall("get", PAUSE_MS, times=None)  # every read, explorations included, until stalled with 0
        slow = [request(manager, next(prompts)) for _ in range(EXPLORE_EVERY + 2)]
        first_bypass = slow.index(0)
        assert first_bypass <= 2, f"two slow fetches are a slow-down: {slow}"
        assert slow[first_bypass:] == [0] * (len(slow) - first_bypass), slow
        explored = remote_stats(manager)["explored"]
        assert explored >= 1

        sim.stall("get", 0)
        recovered = [request(manager, next(prompts)) for _ in range(RECOVERY_BOUND + 4)]
        resumed = next((i for i, served in enumerate(recovered) if served), len(recovered))
        assert resumed <= RECOVERY_BOUND, f"used again within two explorations: {recovered}"
        assert recovered[resumed:] == [PROMPT_BLOCKS] * (len(recovered) - resumed), recovered
        assert remote_stats(manager)["explored"] - explored <= 2
