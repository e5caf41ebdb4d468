"""``benchmarks/scale_vllm.py --quick`` runs under vLLM 0.33 and writes its JSON (listed in
tests/benchmarks/test_quick.py): a row per cell, every request's blocks stored as it decodes, the reference."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, Each, assert_shape, run_quick

GROWTH = ("probe_connector_us", "probe_lookup_first_us", "probe_store_job_us", "decode_connector_us_per_request")
TIMES = ("probe_lookup_first_us", "probe_lookup_answered_us", "probe_alloc_us", "probe_store_job_us", "probe_commit_us",
         "probe_connector_us", "probe_connector_us_per_block", "probe_finish_us", "first_step_us",
         "arrival_schedule_us", "arrival_update_us", "arrival_schedule_vllm_us", "arrival_update_vllm_us",
         "decode_schedule_us", "decode_update_us", "decode_schedule_vllm_us", "decode_update_vllm_us",
         "decode_connector_us", "decode_connector_us_per_request")
ROW = {"blocks": int, "requests": int, "fill_s": NUMBER, **dict.fromkeys(TIMES, NUMBER),
       "decode_hooks_us": Each(NUMBER), "decode_stored_blocks_per_step": NUMBER, "presence_keys_asked": int,
       "max_rss_mb": NUMBER, "growth_base_requests": int, "growth": dict.fromkeys(GROWTH, NUMBER)}
REFERENCE = {"blocks": int, "vllm_hash_us_per_block": {"sha256": NUMBER}, "vllm_lookup_us_per_block": NUMBER,
             "tiercache_keys_us_per_block": NUMBER, "tiercache_lookup_us_per_block": NUMBER,
             "vllm_us_per_block": NUMBER, "tiercache_us_per_block": NUMBER, "keys_vs_hash": NUMBER,
             "lookup_vs_lookup": NUMBER, "ratio": NUMBER, "meets_target": bool, "new_request_requests": int,
             "new_request_us_per_block": NUMBER}
DOCUMENT = {"rows": [ROW], "reference": [REFERENCE], "skipped": list, "presence_latency_ms": NUMBER,
            "block_size": int, "decode_steps": int, "probes": int, "loadavg_before": [NUMBER],
            "loadavg_after": [NUMBER]}


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("scale_vllm.py", tmp_path)
    assert_shape(document, DOCUMENT)
    rows = document["rows"]
    assert [(row["blocks"], row["requests"]) for row in rows] == [(16, 1), (16, 4)]
    assert rows[0]["growth"] == dict.fromkeys(GROWTH, 1.0)
    steps, block = document["decode_steps"], document["block_size"]
    for row in rows:  # every request in flight stored (and the worker's report committed) each block it filled
        assert round(row["decode_stored_blocks_per_step"] * steps) == row["requests"] * steps // block, row
        assert row["probe_store_job_us"] > 0 and row["probe_commit_us"] > 0, row
    assert [ref["blocks"] for ref in document["reference"]] == [16]
