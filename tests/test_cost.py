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


def run_loads(model: CostModel, profile: tuple[float, float], loads: int) -> list[bool]:
    """What a manager does per load: ask, fetch if told to, report the fetch's time."""
    decisions = []
    for _ in range(loads):
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
    [{"prefill_tokens_per_s": 0.0}, {"smoothing": 0.0}, {"explore_fraction": 1.5}, {"margin": -1.0}],
)
def test_bad_settings_name_the_field(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        CostConfig(**options)
