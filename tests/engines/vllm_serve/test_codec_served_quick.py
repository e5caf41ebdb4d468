"""``benchmarks/codec_served.py --quick`` runs a writer and an exact, an int8 and a compact reader of the trained model
over Redis and writes its JSON (listed in tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, assert_shape, run_quick

OPTIONAL = (*NUMBER, type(None))
ROW = {"identical_to_exact_restart": NUMBER, "first_divergence_median": OPTIONAL, "stored_bytes_per_prompt": NUMBER,
       "stored_vs_exact": OPTIONAL, "restart_ttft_median_ms": NUMBER, "restart_ttfts_ms": [NUMBER],
       "counted": {"loaded_blocks": NUMBER, "external_tokens": NUMBER, "int8_blocks_read": NUMBER,
                   "compact_blocks_read": NUMBER}, "answers": [list]}


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("codec_served.py", tmp_path)
    assert_shape(document, {"prompts": {"count": int, "tokens": [int]},
                            "rows": {"exact": ROW, "int8": ROW, "compact": ROW},
                            "stored_bytes": {"exact": int, "int8": int, "compact": int},
                            "exact_restart_equals_writer": bool})
    rows = document["rows"]
    assert rows["int8"]["counted"]["int8_blocks_read"] == rows["int8"]["counted"]["loaded_blocks"] > 0
    assert rows["compact"]["counted"]["compact_blocks_read"] == rows["compact"]["counted"]["loaded_blocks"] > 0
    exact = rows["exact"]["counted"]
    assert exact["int8_blocks_read"] == exact["compact_blocks_read"] == 0 < exact["loaded_blocks"]
    assert rows["compact"]["stored_vs_exact"] < rows["int8"]["stored_vs_exact"], "compact: the smaller level"
    assert 0.2 < rows["int8"]["stored_vs_exact"] < 0.3, "int8 of float32 pages: a quarter and the scales"
