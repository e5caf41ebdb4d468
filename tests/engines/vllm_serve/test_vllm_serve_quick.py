"""``benchmarks/vllm_serve.py --quick`` runs the connector over Redis in a real server, for the trained model on
ShareGPT, the small Llama and the sliding-window model, and writes its JSON (listed in
tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, RESTART_RUN, Each, assert_shape, run_quick

PASS = {"requests": int, "ttft_p50_ms": NUMBER, "ttft_p99_ms": NUMBER, "prompt_tokens": NUMBER,
        "local_hit_tokens": NUMBER, "external_hit_tokens": NUMBER, "prefill_saved": NUMBER,
        "stored_bytes_per_request": NUMBER}
ROW = {"pass1": PASS, "pass2": PASS, "cold": PASS, "outputs_equal_no_cache": (bool, type(None))}
OPTIONAL = (*NUMBER, type(None))
GOALS = {"restart_redis_over_local_hit": OPTIONAL, "miss_redis_over_no_cache": OPTIONAL,
         "sliding_restart_redis_over_local_hit": OPTIONAL, "sliding_miss_redis_over_no_cache": OPTIONAL,
         "real_restart_redis_over_local_hit": OPTIONAL, "real_miss_redis_over_no_cache": OPTIONAL}
BESIDE = {"baseline_gap_ms": NUMBER, "gap_median_ms": NUMBER, "gap_p90_ms": NUMBER, "gap_max_ms": NUMBER,
          "hit_ttft_ms": [NUMBER], "decode_tokens": int}
RESTARTS = {"llama": {"restart": {"runs": [RESTART_RUN], "restart_over_local_median": NUMBER,
                                  "floor_over_local_median": NUMBER},
                      "beside_batch": {"sync": BESIDE, "async": BESIDE}}}
REAL = "SmolLM2 on ShareGPT"


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("vllm_serve.py", tmp_path, "--model-dir", str(tmp_path / "model"), "--sliding-model-dir",
                         str(tmp_path / "sliding-model"))
    rows = {"tiercache redis": ROW, "sliding window (Gemma 3): tiercache redis": ROW, f"{REAL}: tiercache redis": ROW}
    assert_shape(document, {"prompts": Each([int]), "rows": rows, "goals": GOALS, "load_average": [NUMBER],
                            "restart_and_beside_batch": RESTARTS})
    llama = document["restart_and_beside_batch"]["llama"]
    run = llama["restart"]["runs"][0]
    assert run["answers_equal"] and run["external_tokens"] > 0, "the fresh server loaded from Redis, same answers"
    assert run["raw_read_ms"] > 0, "the ceiling read the writer's values back from Redis"
    assert all(row["decode_tokens"] > 0 for row in llama["beside_batch"].values())
