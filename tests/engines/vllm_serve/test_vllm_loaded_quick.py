"""``benchmarks/vllm_loaded.py --quick`` runs the multi-user chat workload on a vLLM whose KV space is smaller than
the working set: tiercache's CPU tier with this tree's code and an older revision's, and Redis, and writes its JSON
(listed in tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, assert_shape, run_quick

ROW = {"requests": int, "wall_s": NUMBER, "ttft_p50_ms": NUMBER, "ttft_p90_ms": NUMBER, "prompt_tokens": NUMBER,
       "computed_tokens": NUMBER, "computed_share": NUMBER, "local_hit_tokens": NUMBER,
       "external_hit_tokens": NUMBER, "stored_mb": NUMBER, "preemptions": NUMBER, "kv_cache_tokens": int,
       "answers_equal": bool, "answers_differing": int}
RATIO = (dict, type(None))
SETTINGS = {"users": int, "rounds": int, "in_flight": int, "system_tokens": int, "user_tokens": [int],
            "answer_tokens": int, "block_size": int, "num_gpu_blocks_override": int, "working_set_blocks": int,
            "kv_share_of_working_set": NUMBER, "cpu_tier_bytes": str, "redis_row_cpu_tier_blocks": int,
            "before": str, "after": str, "first_row": str}
ROWS = ("tiercache redis", "tiercache cpu", "tiercache cpu, before")


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("vllm_loaded.py", tmp_path, "--model-dir", str(tmp_path / "model"))
    assert_shape(document, {"settings": SETTINGS, "rows": dict.fromkeys(ROWS, ROW), "answers_equal": bool,
                            "load_average": [NUMBER],
                            "ratios": {"tiercache_cpu_over_prefix_cache": RATIO,
                                       "tiercache_redis_over_prefix_cache": RATIO,
                                       "prefix_cache_over_no_prefix_cache": RATIO,
                                       "after_over_before": {"wall_s": NUMBER, "ttft_p50_ms": NUMBER,
                                                             "ttft_p90_ms": NUMBER, "computed_tokens": NUMBER}}})
    settings, rows = document["settings"], document["rows"]
    assert settings["kv_share_of_working_set"] < 1, "vLLM's KV space holds the whole working set"
    for name, row in rows.items():
        assert row["kv_cache_tokens"] == settings["num_gpu_blocks_override"] * settings["block_size"], name
        assert row["answers_equal"], f"{name}: {row['answers_differing']} answers differ from the first row's"
        assert row["external_hit_tokens"] > 0, f"{name}: the connector loaded nothing"
