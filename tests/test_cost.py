"""The cost model step by step: bypass starts when fetching gets slower than recomputing, stops on recovery."""

from __future__ import annotations

import pytest

from tiercache.cost import CostConfig, CostModel

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


def run_loads(model: CostModel, profile: tuple[float, float], loads: int, *, probes: bool = False) -> list[bool]:
    """What a manager does per load: (probe the tier,) ask, fetch if told to, report the fetch's time."""
    decisions = []
    for _ in range(loads):
        if probes:
            model.observe_probe(TIER, profile[0])  # a probe is one round trip
        fetch = model.plan(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)
        if fetch:
            model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, fetch_seconds(profile, LOAD_BLOCKS))
        decisions.append(fetch)
    return decisions


def test_bypass_starts_when_slower_than_recompute_and_stops_when_the_tier_recovers() -> None:
    model = enabled_model()
    assert model.plan(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)  # nothing observed: fetch
    assert all(run_loads(model, FAST, 10))

    slow = run_loads(model, SLOW, 200)
    first_bypass = slow.index(False)
    assert first_bypass <= 3  # three slow fetches outweigh the fast past (smoothing 0.2)
    after = slow[first_bypass:]
    explored = after.count(True)
    assert explored == len(after) // 32  # every 32nd would-be bypass still goes through
    counters = model.stats()["tiers"][TIER]
    assert counters["bypassed_slower_than_recompute"] == after.count(False)
    assert counters["explored"] == explored

    recovered = run_loads(model, FAST, 500)
    last_bypass = len(recovered) - 1 - recovered[::-1].index(False)
    assert all(recovered[last_bypass + 1 :])
    assert len(recovered) - last_bypass > 200  # it recovered, and stays recovered
    # Only explored fetches see the recovery; each takes a fifth off the slow past: about eight are needed.
    assert model.stats()["tiers"][TIER]["explored"] - explored <= 10


def requests_recomputed_after_recovery(probes: bool) -> tuple[int, int]:
    """A tier fast, then slow for 200 loads, then fast again: the loads bypassed after it recovered,
    and how many explored fetches the whole run made (each made a request wait on a slow tier)."""
    model = enabled_model()
    run_loads(model, FAST, 10, probes=probes)
    run_loads(model, SLOW, 200, probes=probes)
    recovered = run_loads(model, FAST, 500, probes=probes)
    last_bypass = len(recovered) - 1 - recovered[::-1].index(False) if False in recovered else -1
    assert all(recovered[last_bypass + 1 :])
    return recovered.count(False), model.stats()["tiers"][TIER]["explored"]


def test_a_recovered_tier_is_used_again_at_the_next_lookups_without_an_experiment() -> None:
    """The lookups' probes carry the round trip: a tier fast again is fetched from within two loads.

    Without probes only the explored fetches (1 in 32 would-be bypasses, each a request waiting on
    the tier) show the recovery, and about eight are needed: 240-odd loads recompute.
    """
    recomputed, explored = requests_recomputed_after_recovery(probes=True)
    assert recomputed <= 2
    assert explored <= 200 // 32  # none while recovering: the probes told
    blind_recomputed, _ = requests_recomputed_after_recovery(probes=False)
    assert blind_recomputed > 200


def test_a_tier_slow_in_its_round_trip_is_bypassed_from_the_second_slow_probe() -> None:
    """Two slow probes say a fetch would take 300 ms, before any slow fetch; one out of line is ignored."""
    model = enabled_model()
    run_loads(model, FAST, 10, probes=True)
    assert run_loads(model, SLOW, 5, probes=True) == [True, False, False, False, False]
    hiccup = enabled_model()
    run_loads(hiccup, FAST, 10, probes=True)
    hiccup.observe_probe(TIER, SLOW[0])
    assert run_loads(hiccup, FAST, 3, probes=True) == [True] * 3, "one slow probe among fast ones changes nothing"


def test_one_fetch_size_seen_is_not_all_per_byte() -> None:
    """After 1-block fetches of a 10 ms tier, a 16-block load is about 10 ms (not 160), under 80 ms of prefill."""
    model = CostModel(CostConfig(enabled=True, prefill_tokens_per_s=16 * BLOCK_TOKENS / 0.080))
    for _ in range(10):
        model.observe_fetch(TIER, 1, BLOCK_BYTES, 0.010)
    prior = 1 / CostConfig().prior_bandwidth_bytes_per_s  # per byte, until sizes that spread tell it
    assert model.expected_fetch_seconds(TIER, 16) == pytest.approx(0.010 + 15 * BLOCK_BYTES * prior)
    assert model.plan(TIER, 16, 16 * BLOCK_TOKENS)
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
    answers = {model.usable_prefix(runs, BLOCK_TOKENS, record=False) for _ in range(100)}
    assert answers == {2} and model.stats()["tiers"][TIER] == before
    assert model.usable_prefix(runs, BLOCK_TOKENS) == 2  # recorded once, at the load
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
    assert not model.plan(TIER, 2, 2 * BLOCK_TOKENS)
    assert model.plan(TIER, 256, 256 * BLOCK_TOKENS)


def test_usable_prefix_stops_before_the_first_tier_not_worth_fetching() -> None:
    model = enabled_model()
    for blocks in (8, 32):
        model.observe_fetch("near", blocks, blocks * BLOCK_BYTES, fetch_seconds(FAST, blocks))
        model.observe_fetch("far", blocks, blocks * BLOCK_BYTES, fetch_seconds(SLOW, blocks))
    runs = [(None, 4), ("near", 8), (None, 2), ("far", 8), ("near", 2)]
    # near: 10 blocks in 1.7 ms against 20 blocks (32 ms) of prefill is worth it; far: 300 ms against
    # the last 10 blocks (16 ms) is not, and cutting there also drops near's 2 blocks behind it.
    assert model.usable_prefix(runs, BLOCK_TOKENS) == 14
    assert model.stats()["tiers"]["far"]["bypassed_slower_than_recompute"] == 1
    assert model.usable_prefix([(None, 6)], BLOCK_TOKENS) == 6
    slow_first = [("far", 2), ("near", 30)]
    assert model.usable_prefix(slow_first, BLOCK_TOKENS) == 0  # 300 ms against 51 ms of prefill
    assert model.stats()["tiers"]["near"]["fetches_planned"] == 1  # near was never weighed the second time


def test_observed_prefill_rate_replaces_the_configured_one() -> None:
    model = enabled_model()
    model.observe_fetch(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_BYTES, 0.02)  # 20 ms: faster than 51.2 ms
    assert model.plan(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)
    model.observe_prefill(tokens=100_000, seconds=1.0)  # the engine is 10x faster than configured: 5.1 ms
    assert model.prefill_tokens_per_s == pytest.approx(100_000)
    assert not model.plan(TIER, LOAD_BLOCKS, LOAD_BLOCKS * BLOCK_TOKENS)


def test_unknown_rate_or_disabled_model_always_fetches() -> None:
    for model in (CostModel(CostConfig(enabled=True)), CostModel(CostConfig(prefill_tokens_per_s=1.0))):
        model.observe_fetch(TIER, 1, BLOCK_BYTES, 10.0)
        assert model.plan(TIER, 1, BLOCK_TOKENS)
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
