"""``benchmarks/vllm_lookup.py --quick`` runs under vLLM 0.33 and writes its JSON (listed in
tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, assert_shape, run_quick

ROW = {"prompt": str, "chunks": int, "tier": str, "first_us_per_lookup": NUMBER, "answered_us_per_lookup": NUMBER,
       "repetitions": int, "first_vs_fs": NUMBER, "answered_vs_fs": NUMBER}


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("vllm_lookup.py", tmp_path)
    assert_shape(document, {"rows": [ROW], "loadavg_before": [NUMBER], "loadavg_after": [NUMBER]})
    assert sorted(row["tier"] for row in document["rows"]) == ["fs", "tiercache"]
