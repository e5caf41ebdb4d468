"""``benchmarks/vllm_serve.py --quick`` runs one real server with the connector over Redis and writes its JSON
(listed in tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, assert_shape, run_quick

PASS = {"requests": int, "ttft_p50_ms": NUMBER, "ttft_p99_ms": NUMBER, "prompt_tokens": NUMBER,
        "local_hit_tokens": NUMBER, "external_hit_tokens": NUMBER, "prefill_saved": NUMBER}
ROW = {"pass1": PASS, "pass2": PASS, "cold": PASS, "outputs_equal_no_cache": (bool, type(None))}
GOALS = {"restart_redis_over_ceiling": (*NUMBER, type(None)), "miss_redis_over_no_cache": (*NUMBER, type(None))}


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("vllm_serve.py", tmp_path, "--model-dir", str(tmp_path / "model"))
    assert_shape(document, {"prompts": [int], "rows": {"tiercache redis": ROW}, "goals": GOALS,
                            "load_average": [NUMBER]})
