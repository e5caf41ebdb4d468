"""The cost model step by step: bypass starts when fetching gets slower than recomputing, stops on recovery."""

from __future__ import annotations

import pytest

from tiercache.config.cost_options import CostConfig
from tiercache.manager.cost import STALE_FLOOR_WEIGHT, CostModel, Verdict

BLOCK_TOKENS = 16
BLOCK_BYTES = 64 * 1024
PREFILL_TOKENS_PER_S = 10_000.0
LOAD_BLOCKS = 32
"""One load: 512 tokens, 51.2 ms to recompute at the configured rate."""
FAST = (0.001, 1e9)
"""(latency s, bytes/s) of a healthy tier: a 2 MiB load in about 3 ms."""
SLOW = (0.3, 1e9)
"""The same tier with 300 ms of latency: every load is slower than recomputing it."""
TIER = "redis"


def fetch_seconds(profile: tuple[float, float], blocks: int) -> float:
    latency, throughput = profile
    return latency + blocks * BLOCK_BYTES / throughput


def enabled_model(**options: float) -> CostModel:
    return CostModel(CostConfig(enabled=True, prefill_tokens_per_s=PREFILL_TOKENS_PER_S, **options))


def plan(model: CostModel, blocks: int, tokens: int, tier: str = TIER) -> Verdict | None:
    """What a lookup asks and its load counts, for one tier's part of a request."""
    return model.count(tier, model.verdict(tier, blocks, tokens))


def run_loads(
    model: CostModel, profile: tuple[float, float], loads: int, *, presence_checks: bool = False
) -> list[bool]:
    """What a manager does per request: (check the tier's presence,) ask, count. The request fetches on ``FETCH``;
    on ``EXPLORE`` it recomputes while the same fetch runs in the background and is reported when it ends.
    Returns, per request, whether it fetched."""
    fetched = []
    for _ in range(loads):
        if presence_checks:
            model.observe_presence_check(TIER, profile[0])  # a presence check is one round trip
        counted = plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)
        seconds = fetch_seconds(profile, LOAD_BLOCKS)
        if counted is Verdict.FETCH:
            model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, seconds)
        elif counted is Verdict.EXPLORE:
            model.exploration_ended(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, seconds)
        fetched.append(counted is Verdict.FETCH)
    return fetched


EXPLORE_EVERY = round(1 / CostConfig().explore_fraction)


def test_bypass_starts_when_slower_than_recompute_and_stops_when_the_tier_recovers() -> None:
    model = enabled_model()
    assert plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS) is Verdict.FETCH  # nothing observed: fetch
    assert all(run_loads(model, FAST, 10))

    slow = run_loads(model, SLOW, 200)
    first_bypass = slow.index(False)
    assert first_bypass <= 3  # three slow fetches outweigh the fast past (smoothing 0.2)
    after = slow[first_bypass:]
    assert not any(after), "no request fetches from a bypassed tier, not even to explore it"
    counters = model.stats()["tiers"][TIER]
    assert counters["bypassed_slower_than_recompute"] == len(after)
    explored = counters["explored"]
    assert explored == len(after) // EXPLORE_EVERY  # every n-th would-be bypass explores, in the background

    recovered = run_loads(model, FAST, 500)
    last_bypass = len(recovered) - 1 - recovered[::-1].index(False)
    assert all(recovered[last_bypass + 1 :])
    # The bypassed requests aged the slow past: the next exploration (due within n requests) forgets a tier
    # six times slower than recomputing.
    assert last_bypass < EXPLORE_EVERY
    assert model.stats()["tiers"][TIER]["explored"] - explored == 1


def requests_recomputed_after_recovery(presence_checks: bool) -> int:
    """A tier fast, then slow for 200 requests, then fast again: the requests that recomputed after it recovered."""
    model = enabled_model()
    run_loads(model, FAST, 10, presence_checks=presence_checks)
    run_loads(model, SLOW, 200, presence_checks=presence_checks)
    recovered = run_loads(model, FAST, 500, presence_checks=presence_checks)
    last_bypass = len(recovered) - 1 - recovered[::-1].index(False) if False in recovered else -1
    assert all(recovered[last_bypass + 1 :])
    return recovered.count(False)


def test_a_recovered_tier_is_used_again_at_the_next_lookups_without_an_experiment() -> None:
    """The lookups' presence checks carry the round trip: a tier fast again is fetched from within two requests.

    Without presence checks only the explorations (in the background) show the recovery; the past they are weighed
    against went stale while the tier was bypassed, so the next one is enough.
    """
    assert requests_recomputed_after_recovery(presence_checks=True) <= 2
    assert requests_recomputed_after_recovery(presence_checks=False) <= EXPLORE_EVERY


def test_one_exploration_in_flight_per_tier() -> None:
    """Two requests judged ``EXPLORE`` before either was counted: the second recomputes without exploring,
    and none is due until the one in flight has ended, whatever it found."""
    model = enabled_model(explore_fraction=1.0)
    model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, fetch_seconds(SLOW, LOAD_BLOCKS))
    first = model.verdict(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)
    second = model.verdict(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)
    assert first is second is Verdict.EXPLORE
    assert [model.count(TIER, first), model.count(TIER, second)] == [Verdict.EXPLORE, Verdict.BYPASS]
    assert [plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS) for _ in range(3)] == [Verdict.BYPASS] * 3
    assert model.stats()["tiers"][TIER]["explorations_in_flight"] == 1
    model.exploration_ended(TIER)  # never asked (starved, cancelled): nothing observed
    assert model.stats()["tiers"][TIER]["observations"] == 1
    assert plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS) is Verdict.EXPLORE
    counters = model.stats()["tiers"][TIER]
    assert (counters["explored"], counters["bypassed_slower_than_recompute"]) == (2, 6)


def test_staleness_stops_at_its_floor() -> None:
    """Ten thousand bypasses leave the fit's past at a tenth of a fetch (its floor): its estimate stands until an
    exploration. The fit then weighs that past at its floor; the estimate is the faster of the two fetches seen
    (``RecentFetches``: a slow one needs a second witness)."""
    model = enabled_model(explore_fraction=1 / 20_000)
    model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, fetch_seconds(SLOW, LOAD_BLOCKS))
    estimate = model.expected_fetch_seconds(TIER, LOAD_BLOCKS)
    assert [plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS) for _ in range(10_000)] == [Verdict.BYPASS] * 10_000
    assert model.expected_fetch_seconds(TIER, LOAD_BLOCKS) == pytest.approx(estimate)
    model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, fetch_seconds(FAST, LOAD_BLOCKS))
    fast, slow = fetch_seconds(FAST, LOAD_BLOCKS), fetch_seconds(SLOW, LOAD_BLOCKS)
    stale = STALE_FLOOR_WEIGHT * (1 - CostConfig().smoothing)
    prior_part = LOAD_BLOCKS * BLOCK_BYTES / CostConfig().prior_bandwidth_bytes_per_s  # one size: slope at the prior
    fitted = (stale * slow + fast) / (stale + 1)
    assert model.stats()["tiers"][TIER]["latency_s"] == pytest.approx(fitted - prior_part)
    assert model.expected_fetch_seconds(TIER, LOAD_BLOCKS) == pytest.approx(min(fitted, fast))


def test_a_tier_slow_in_its_round_trip_is_bypassed_from_the_second_slow_presence_check() -> None:
    """Two slow presence checks say a fetch would take 300 ms, before any slow fetch; one out of line is ignored."""
    model = enabled_model()
    run_loads(model, FAST, 10, presence_checks=True)
    assert run_loads(model, SLOW, 5, presence_checks=True) == [True, False, False, False, False]
    hiccup = enabled_model()
    run_loads(hiccup, FAST, 10, presence_checks=True)
    hiccup.observe_presence_check(TIER, SLOW[0])
    assert run_loads(hiccup, FAST, 3, presence_checks=True) == [True] * 3, "one slow check changes nothing"


def test_one_fetch_size_seen_is_not_all_per_byte() -> None:
    """After 1-block fetches of a 10 ms tier, a 16-block load is about 10 ms (not 160), under 80 ms of prefill."""
    model = CostModel(CostConfig(enabled=True, prefill_tokens_per_s=16 * BLOCK_TOKENS / 0.080))
    for _ in range(10):
        model.observe_fetch(TIER, 1, BLOCK_BYTES, 0.010)
    prior = 1 / CostConfig().prior_bandwidth_bytes_per_s  # per byte, until sizes that spread tell it
    assert model.expected_fetch_seconds(TIER, 16) == pytest.approx(0.010 + 15 * BLOCK_BYTES * prior)
    assert plan(model, 16, 16 * BLOCK_TOKENS) is Verdict.FETCH
    assert model.stats()["tiers"][TIER]["latency_s"] == pytest.approx(0.010 - BLOCK_BYTES * prior)


def test_sizes_that_barely_differ_lean_on_the_prior_not_on_their_scatter() -> None:
    """16- and 17-block fetches with 1 ms of jitter: the line through them alone says next to nothing about
    256 blocks, so the slope stays near the prior's (1 GB/s; the tier does 4), a conservative answer."""
    true_profile = (0.010, 4e9)
    model = enabled_model()
    for i in range(40):
        blocks = 16 + i % 2
        jitter = 0.001 * (1 if i % 4 in (1, 2) else -1)
        model.observe_fetch(TIER, blocks, blocks * BLOCK_BYTES, fetch_seconds(true_profile, blocks) + jitter)
    predicted = model.expected_fetch_seconds(TIER, 256)
    prior_bound = true_profile[0] + 256 * BLOCK_BYTES / CostConfig().prior_bandwidth_bytes_per_s
    assert fetch_seconds(true_profile, 256) * 0.9 <= predicted <= prior_bound * 1.1


def test_a_lookup_asked_again_gets_the_same_cut_and_counts_nothing() -> None:
    model = enabled_model()
    run_loads(model, SLOW, 3)
    before = dict(model.stats()["tiers"][TIER])
    runs = [(None, 2), (TIER, LOAD_BLOCKS)]
    answers = {model.cut(runs, BLOCK_TOKENS)[0] for _ in range(100)}
    assert answers == {2} and model.stats()["tiers"][TIER] == before
    assert usable(model, runs) == 2  # counted once, at the load
    bypassed = model.stats()["tiers"][TIER]["bypassed_slower_than_recompute"]
    assert bypassed == before["bypassed_slower_than_recompute"] + 1


def test_latency_and_throughput_are_fitted_per_batch_size() -> None:
    """A far tier (50 ms, 10 GB/s) is not worth it for 2 blocks (3 ms of prefill) but is for 256."""
    far = (0.05, 10e9)
    model = enabled_model()
    for blocks in (1, 4, 16, 64, 256):
        model.observe_fetch(TIER, blocks, blocks * BLOCK_BYTES, fetch_seconds(far, blocks))
    stats = model.stats()["tiers"][TIER]
    assert stats["latency_s"] == pytest.approx(far[0])
    assert stats["throughput_bytes_per_s"] == pytest.approx(far[1])
    assert model.expected_fetch_seconds(TIER, 100) == pytest.approx(fetch_seconds(far, 100), rel=0.01)
    assert plan(model, 2, 2 * BLOCK_TOKENS) is not Verdict.FETCH
    assert plan(model, 256, 256 * BLOCK_TOKENS) is Verdict.FETCH


def usable(model: CostModel, runs: list[tuple[str | None, int]]) -> int:
    """``cut``, each verdict counted: one request that goes ahead."""
    usable, verdicts = model.cut(runs, BLOCK_TOKENS)
    for tier, verdict in verdicts:
        model.count(tier, verdict)
    return usable


def test_the_cut_stops_before_the_first_tier_not_worth_fetching() -> None:
    model = enabled_model()
    for blocks in (8, 32):
        model.observe_fetch("near", blocks, blocks * BLOCK_BYTES, fetch_seconds(FAST, blocks))
        model.observe_fetch("far", blocks, blocks * BLOCK_BYTES, fetch_seconds(SLOW, blocks))
    runs = [(None, 4), ("near", 8), (None, 2), ("far", 8), ("near", 2)]
    # near: 10 blocks in 1.7 ms against 20 blocks (32 ms) of prefill is worth it; far: 300 ms against
    # the last 10 blocks (16 ms) is not, and cutting there also drops near's 2 blocks behind it.
    assert usable(model, runs) == 14
    assert model.stats()["tiers"]["far"]["bypassed_slower_than_recompute"] == 1
    assert usable(model, [(None, 6)]) == 6
    slow_first = [("far", 2), ("near", 30)]
    assert usable(model, slow_first) == 0  # 300 ms against 51 ms of prefill
    assert model.stats()["tiers"]["near"]["fetches_planned"] == 1  # near was never weighed the second time


def test_observed_prefill_rate_replaces_the_configured_one() -> None:
    model = enabled_model()
    model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, 0.02)  # 20 ms: faster than 51.2 ms
    assert plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS) is Verdict.FETCH
    model.observe_prefill(tokens=100_000, seconds=1.0)  # the engine is 10x faster than configured: 5.1 ms
    assert model.prefill_tokens_per_s == pytest.approx(100_000)
    assert plan(model, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS) is Verdict.BYPASS


def test_unknown_rate_or_disabled_model_always_fetches() -> None:
    unknown_rate, disabled = CostModel(CostConfig(enabled=True)), CostModel(CostConfig(prefill_tokens_per_s=1.0))
    for model, verdict in ((unknown_rate, Verdict.FETCH), (disabled, None)):
        model.observe_fetch(TIER, 1, BLOCK_BYTES, 10.0)
        assert plan(model, 1, BLOCK_TOKENS) is verdict
        assert model.stats()["tiers"][TIER]["bypassed_slower_than_recompute"] == 0


@pytest.mark.parametrize(
    "options",
    [
        {"prefill_tokens_per_s": 0.0},
        {"smoothing": 0.0},
        {"explore_fraction": 1.5},
        {"margin": -1.0},
        {"prior_bandwidth_bytes_per_s": 0.0},
    ],
)
def test_bad_settings_name_the_field(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        CostConfig(**options)
