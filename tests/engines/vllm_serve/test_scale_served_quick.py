"""``benchmarks/scale_served.py --quick`` serves a tiny Llama with and without README's Redis connector line, misses
then hits from tiercache's CPU tier, its scheduler timed step by step, and writes its JSON (listed in
tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, assert_shape, run_quick

SPREAD = {"p50_ms": NUMBER, "p90_ms": NUMBER, "p99_ms": NUMBER}
STEPS = {"steps": int, "empty_steps": int, "schedule": SPREAD, "update": SPREAD, "scheduler": SPREAD,
         "connector": SPREAD, "schedule_connector": SPREAD, "step": SPREAD, "connector_share_of_scheduler": NUMBER,
         "connector_hooks_mean_ms": dict, "scheduler_share_of_step": NUMBER, "running_p50": NUMBER,
         "running_max": int, "waiting_max": int}
ROUND = {"requests": int, "wall_s": NUMBER, "requests_per_s": NUMBER, "tokens_per_s": NUMBER,
         "latency_p50_ms": NUMBER, "latency_p99_ms": NUMBER, "prompt_tokens": NUMBER, "local_hit_tokens": NUMBER,
         "external_hit_tokens": NUMBER, "answers_equal": bool, "steps": STEPS}
ROW = {"requests_per_s": NUMBER, "tokens_per_s": NUMBER, "external_hit_tokens": NUMBER, "local_hit_tokens": NUMBER,
       "answers_equal": bool, "steps": STEPS, "rounds": [ROUND]}
ALONE, CONNECTED = "vLLM alone", "tiercache redis (README's line)"
RATIOS = {"misses_requests_per_s": NUMBER, "misses_requests_per_s_rounds": [NUMBER], "misses_meets_target": bool,
          "target": NUMBER, "hits_scheduler_step": SPREAD, "hits_requests_per_s": NUMBER}


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("scale_served.py", tmp_path, "--model-dir", str(tmp_path / "model"))
    passes = {"misses": ROW, "hits": ROW}
    assert_shape(document, {"settings": dict, "rows": {ALONE: passes, CONNECTED: passes}, "ratios": RATIOS,
                            "answers_equal": bool, "load_average": {"start": [NUMBER], "end": [NUMBER]}})
    rows, settings = document["rows"], document["settings"]
    assert document["answers_equal"], "greedy answers differ between rows or passes"
    assert settings["max_num_seqs"] >= 256
    assert settings["connector"]["kv_connector_extra_config"]["topology"]["tiers"][1]["type"] == "redis"
    for name, passes in rows.items():
        for kind, row in passes.items():
            steps = row["steps"]
            assert steps["steps"] > 0, f"{name}, {kind}: no scheduler step timed"
            assert 0 < steps["running_max"] <= settings["concurrency"], f"{name}, {kind}: {steps['running_max']}"
            assert row["local_hit_tokens"] == 0, f"{name}, {kind}: vLLM's own cache hit a prompt"
            connector_us = steps["connector"]["p99_ms"]
            assert (connector_us > 0) == (name == CONNECTED), f"{name}, {kind}: connector time {connector_us} ms"
    assert rows[ALONE]["hits"]["external_hit_tokens"] == 0
    hooks = rows[CONNECTED]["hits"]["steps"]["connector_hooks_mean_ms"]
    assert {"get_num_new_matched_tokens", "build_connector_meta", "update_connector_output"} <= set(hooks), hooks
    assert rows[CONNECTED]["misses"]["external_hit_tokens"] == 0, "a miss was served by the connector"
    hits, prompt_tokens = rows[CONNECTED]["hits"], rows[CONNECTED]["hits"]["rounds"][0]["prompt_tokens"]
    assert hits["external_hit_tokens"] >= prompt_tokens - settings["requests"] * settings["block_size"], (
        "the hits pass was not loaded from tiercache's CPU tier")
