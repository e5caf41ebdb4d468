"""Live miss-ratio curves against libCacheSim's exact LRU on the same trace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tiercache.telemetry.mrc import DEFAULT_MAX_SAMPLES, DEFAULT_MULTIPLES, MissRatioCurve
from tiercache.testing.mrc_reference import block_key, exact_lru_curve, zipf_keys
from tiercache.testing.policy_traces import Trace, zipf, zipf_with_scans

ACCESSES = 1_000_000
KEY_SPACE = 2_000_000
"""Zipf over 2M keys: the 1M accesses touch about 370K of them, a wide stream as a remote tier sees."""
ZIPF_ALPHA = 0.9
CAPACITY = 50_000
"""The tier's capacity; the curve is checked at 0.25x .. 4x of it."""
TOLERANCE = 0.02
"""Two points of hit ratio (issue 15), for every run at every size."""
SEEDS = 3
"""Independent sample sets (sampling seeds) checked at rate 0.01. SHARDS's error comes from which keys
are sampled: on this trace its standard deviation is about a point (8 of 8 seeds within 2 points,
benchmarks/mrc.py); on a trace with fewer, hotter keys it is larger (that benchmark shows both)."""
FIXED_SIZE = 8_000
FIXED_SIZE_START_RATE = 0.1
REQUEST_KEYS = 64
"""Keys per access_many call: one 1024-token prompt of 16-token blocks."""


@pytest.fixture(scope="module")
def trace() -> tuple[Trace, list[bytes]]:
    return zipf_keys(ACCESSES, KEY_SPACE, ZIPF_ALPHA)


@pytest.fixture(scope="module")
def exact(trace: tuple[Trace, list[bytes]], tmp_path_factory: pytest.TempPathFactory) -> dict[float, float]:
    """libCacheSim's LRU hit ratio at each size: the exact curve."""
    path = tmp_path_factory.mktemp("mrc") / "zipf.oracleGeneral"
    return exact_lru_curve(trace[0], path, CAPACITY, DEFAULT_MULTIPLES)


def estimates(keys: list[bytes], seeds: int, **options: float) -> list[dict[float, float]]:
    """One curve per sampling seed, each fed the way a tier feeds it: one request's keys at a time."""
    curves = []
    for seed in range(seeds):
        mrc = MissRatioCurve(seed=seed, **options)
        for start in range(0, len(keys), REQUEST_KEYS):
            mrc.access_many(keys[start : start + REQUEST_KEYS])
        curves.append(mrc.curve(CAPACITY))
        stats = mrc.stats()
        assert stats["accesses"] == len(keys)
        if "max_samples" in options:
            assert stats["tracked_keys"] <= options["max_samples"]
    return curves


def check(curves: list[dict[float, float]], exact: dict[float, float]) -> None:
    """Every run within 2 points of exact LRU at every size, and never falling as the size grows."""
    for curve in curves:
        errors = {m: round(curve[m] - exact[m], 4) for m in DEFAULT_MULTIPLES}
        assert max(abs(e) for e in errors.values()) <= TOLERANCE, (errors, exact)
        assert list(curve.values()) == sorted(curve.values())


def test_rate_001_within_two_points_of_exact_lru(
    trace: tuple[Trace, list[bytes]], exact: dict[float, float]
) -> None:
    check(estimates(trace[1], SEEDS, sample_rate=0.01), exact)


def test_fixed_size_variant_within_two_points_of_exact_lru(
    trace: tuple[Trace, list[bytes]], exact: dict[float, float]
) -> None:
    check(estimates(trace[1], 1, sample_rate=FIXED_SIZE_START_RATE, max_samples=FIXED_SIZE), exact)


SMALL_TIER = 1024
"""A small tier (a GPU pool of 1024 blocks): the curve is checked at 256 .. 4096 blocks."""
SMALL_TIER_TRACES: dict[str, Callable[[], Trace]] = {
    "zipf0.8": lambda: zipf(120_000, n_keys=24_000, alpha=0.8, seed=21),
    "zipf1.0": lambda: zipf(160_000, n_keys=80_000, alpha=1.0, seed=22),
    "zipf0.9_scans": lambda: zipf_with_scans(
        160_000, n_keys=40_000, alpha=0.9, scan_every=4_000, scan_length=1_500, seed=23
    ),
}
"""Zipf 0.8 and 1.0 and a scan-mixed trace, 20K to 77K distinct keys each."""


@pytest.mark.parametrize(("seed", "name"), list(enumerate(SMALL_TIER_TRACES)))
def test_the_default_is_within_two_points_for_a_small_tier(name: str, seed: int, tmp_path: Path) -> None:
    """The default (a fixed-size sample) against exact LRU: a fixed rate of 0.01 is off by 5-20 points here."""
    ids = SMALL_TIER_TRACES[name]()
    key_of = {obj_id: block_key(obj_id) for obj_id in set(ids)}
    keys = [key_of[obj_id] for obj_id in ids]
    assert 17_000 <= len(key_of) <= 80_000
    exact = exact_lru_curve(ids, tmp_path / "trace.oracleGeneral", SMALL_TIER, DEFAULT_MULTIPLES)
    mrc = MissRatioCurve(seed=seed)
    for start in range(0, len(keys), REQUEST_KEYS):
        mrc.access_many(keys[start : start + REQUEST_KEYS])
    curve = mrc.curve(SMALL_TIER)
    errors = {m: round(curve[m] - exact[m], 4) for m in DEFAULT_MULTIPLES}
    assert max(abs(e) for e in errors.values()) <= TOLERANCE, (errors, exact)
    assert mrc.stats()["tracked_keys"] <= DEFAULT_MAX_SAMPLES


def test_exact_at_full_rate_on_a_small_trace() -> None:
    """At rate 1 every access is sampled, so the curve is LRU's exactly (checked by hand)."""
    a, b, c = (block_key(i) for i in range(3))
    mrc = MissRatioCurve(sample_rate=1.0, flush_keys=2)
    for key in (a, b, c, a, b, c, c):
        mrc.access(key)
    # a, b, c: cold; a, b, c again: two other keys since (hit with 3 blocks); c: distance 0.
    assert mrc.curve(1, (1, 2, 3)) == pytest.approx({1: 1 / 7, 2: 1 / 7, 3: 4 / 7})
    assert mrc.curve(0) == dict.fromkeys(DEFAULT_MULTIPLES, 0.0)
    summary = mrc.summary(2)
    assert summary["hit_ratio"] == pytest.approx({"0.25": 1 / 7, "0.5": 1 / 7, "1": 1 / 7, "2": 4 / 7, "4": 4 / 7})
    assert (summary["capacity_blocks"], summary["accesses"], summary["tracked_keys"]) == (2, 7, 3)


def test_buffered_accesses_count_before_a_flush_and_keys_of_any_length() -> None:
    mrc = MissRatioCurve(sample_rate=1.0)
    mrc.access_many([b"short-key-1", b"short-key-1"])  # not 16 bytes: the exact per-key path
    assert mrc.hit_ratio(1) == pytest.approx(0.5)
    assert MissRatioCurve().curve(10) == dict.fromkeys(DEFAULT_MULTIPLES, 0.0)


def test_invalid_arguments_are_refused() -> None:
    for kwargs in ({"sample_rate": 0.0}, {"sample_rate": 1.5}, {"max_samples": 0}, {"key_bytes": 4}):
        with pytest.raises(ValueError):
            MissRatioCurve(**kwargs)
