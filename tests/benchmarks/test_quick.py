"""Every benchmark's ``--quick`` mode runs and writes its JSON in the shape the docs read, so no script rots unseen.

The scripts that need an engine run in that engine's suite (``ENGINE_RUNS``); the rest
run here (``QUICK_RUNS``), each in a subprocess with this venv's python, writing into
``tmp_path``, never over the committed results. A new script in ``benchmarks/`` fails
``test_every_benchmark_has_one_quick_test`` until it gets one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from support.benchmark_runs import BENCHMARKS, NUMBER, Each, assert_shape, run_quick

TESTS = Path(__file__).resolve().parents[1]
HELPERS = {"common.py", "oracle.py", "redis_ceiling.py", "gpu_connector_parts.py", "gpu_connector_async.py",
           "gpu_connector_breaks.py", "gpu_connector_worker.py", "beside_batch.py", "scale_vllm_parts.py"}
"""Modules the scripts import; not benchmarks themselves."""
ENGINE_RUNS = {
    "vllm_lookup.py": "engines/vllm/test_vllm_lookup_quick.py",
    "scale_vllm.py": "engines/vllm/test_scale_vllm_quick.py",
    "sglang_transfers.py": "engines/sglang/test_sglang_transfers_quick.py",
    "vllm_serve.py": "engines/vllm_serve/test_vllm_serve_quick.py",
    "vllm_loaded.py": "engines/vllm_serve/test_vllm_loaded_quick.py",
    "codec_served.py": "engines/vllm_serve/test_codec_served_quick.py",
    "restart_rows.py": "engines/vllm_serve/test_restart_rows_quick.py",
    "scale_served.py": "engines/vllm_serve/test_scale_served_quick.py",
}
"""Benchmarks run by an engine's suite, in its venv (``scripts/test.sh``), and the test that runs each."""

N = NUMBER
LOAD = [N]
LATENCY = {"mean_ms": N, "p50_ms": N, "p95_ms": N}
SIMULATION = {"requests": int, "prompt_tokens": int, "reused_share": Each(N), "prefill_saved_share": N,
              "ttft_ms": {"mean": N, "p50": N, "p99": N}, "mismatched_blocks": int}
COST_RUN = {**SIMULATION, "bypassed_slower_than_recompute": int, "explored": int,
            "requests_waited_on_exploration": int, "transfer_ms_per_block": Each(N)}
RECOVERY_RUN = {**COST_RUN, "recovered_at_request": int, "remote_weighed_after_recovery": int,
                "recomputed_after_recovery": int, "last_recomputed_after_recovery": int}
POLICY_SIZE = {"size": int, "miss_ratio": {"ours": Each(N), "libcachesim": Each(N), "belady": N, "cachetools_lru": N},
               "max_abs_diff_vs_libcachesim": N,
               "decisions_per_s": {"ours": Each(N), "cachetools_lru": N, "libcachesim": Each(N)}}
MRC_TRACE = {"accesses": int, "distinct_keys": int, "capacities": [int], "exact_lru_hit_ratio": Each([N]),
             "accuracy": Each(Each({"mean_abs_error_per_size": [N], "max_abs_error_per_size": [N],
                                    "runs_within_2_points": int, "runs": int, "tracked_keys_max": int})),
             "default_worst_abs_error": Each(N)}
FLOOD_PHASE = {"seconds": N, "calls": int, "api_max_ms": N, "api_p99_ms": N, "published": int, "published_per_s": N,
               "max_queued": int, "longest_publish_gap_ms": N}
REDIS_ROW = {"target": str, "size": str, "op": str, "redis_benchmark_gbps": N, "redis_benchmark_setting": str,
             "redis_benchmark_failed_settings": list, "redis_benchmark_sweep_gbps": N, "tier_gbps": N,
             "tier_vs_ceiling": N, "tier_vs_sweep": N, "tier_client_cpu_us_per_value": N,
             "server_cpu_us_per_value": N, "rounds": [{"redis_benchmark_sweep": N, "redis_benchmark": N, "tier": N}]}
LOOP_COLUMNS = {"socket_loop_compared": str, "tier_vs_socket_loop": N}
FILE_ROW = {"size": str, "shape": str, "op": str, "dd_gbps": N, "dd_distinct_gbps": N, "tier_gbps": N,
            "tier_vs_dd": N, "tier_vs_dd_distinct": N, "runs": [{"dd": N, "dd_distinct": N, "tier": N}]}
SYNC_READS = ("redis tier GET (ceiling)", "regional plain read", "force_latest, region current",
              "force_latest, region stale")
FILE_GET_COLUMNS = {"reader_threads": int, "dd_parallel_gbps": N, "tier_vs_dd_parallel": N, "dd_parallel_vs_dd": N}

CODEC_ROW = {"level": str, "size_vs_16bit": N, "size_vs_engine_dtype": N, "perplexity_change_mean": N,
             "perplexity_change_worst": N, "top1_agreement": N, "mean_kl_nats": N, "positions": int}
RESTART = {"ttft_s": N, "loaded_tokens": int, "computed_tokens": int, "levels": dict}
SWEEP_LOAD = {"load_average": {"before": LOAD, "after": LOAD}, "seconds": N}
SCALE_SWEEPS = {
    "requests": {**SWEEP_LOAD, "rows": [{"requests": int, "blocks": int, "keys_held": int, "new_request_us": N,
                                         "reference_us": N, "reference_step_us": N,
                                         "phases_us": Each(N), "step_us_per_request": N, "growth": N,
                                         "step_growth": N, "complete": bool}]},
    "cpu_tier": {**SWEEP_LOAD, "rows": [{"policy": str, "capacity_blocks": int, "store_us_per_block": N,
                                         "evict_us_per_block": N, "lookup_us_per_block": N,
                                         "prompt_lookup_us_per_block": N, "dict_lookup_us": N,
                                         "growth": Each(N), "dict_growth": N}],
                 "metadata_bytes_per_block": Each({"empty_tier": N, "filled": N, "steady": N})},
    "redis_keys": {**SWEEP_LOAD, "rows": [{"keys_held": int, "contains_held_lane_us": N, "contains_held_raw_us": N,
                                           "get_lane_us": N, "get_raw_us": N, "beyond_value_bytes": N}]},
    "small_hit": {**SWEEP_LOAD, "rows": [{"block": str, "ceiling_p50_us": N, "tier_manager_ratio": N,
                                          "lower_tiers_ratio": N}], "bulk": [dict]},
    "events": {**SWEEP_LOAD, "rows": [{"blocks_held": int, "added_us_per_block": N, "zmq_8_events_per_s": N,
                                       "callback_8_events_per_s": N}]},
    "host": {**SWEEP_LOAD, "socket_echo_p50_us": N,
             "hits": [{"block": str, "host": {"p50_us": N, "p99_us": N}, "lower_tiers": {"p50_us": N, "p99_us": N},
                       "ceiling_p50_us": N, "host_ratio": N, "lower_tiers_ratio": N}],
             "rows": [{"keys": int, "host_us": N, "host_us_per_key": N, "lower_us_per_key": N,
                       "host_call_vs_echo": N}],
             "engines": [{"engines": int, "lookup_p50_us": N, "growth": N}]},
}
QUICK_RUNS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "scale.py": ((), {"sweeps": SCALE_SWEEPS}),
    "codec.py": ((), {"learned": int, "judged": int, "tables_digest": str, "rows": [CODEC_ROW]}),
    "codec_link.py": ((), {"prompt_tokens": int, "block_bytes": int, "rows": [{
        "link_bits_per_s": N, "round_trip_s": N, "recompute": RESTART, "exact": RESTART, "int8": RESTART,
        "compact": RESTART, "adaptive": RESTART, "adaptive_vs_best_fixed": N, "exact_vs_adaptive": N}]}),
    "keys.py": ((), {"tokens": int, "rows": [{
        "block_size": int, "numpy_tokens_per_s": N, "list_tokens_per_s": N, "bare_chain_tokens_per_s": N,
        "ratio_to_bare_chain": N, "meets_target": bool}]}),
    "policies.py": ((), {"requests_per_trace": int, "repeat": int,
                         "traces": {name: {"requests": int, "distinct_keys": int, "sizes": [POLICY_SIZE]}
                                    for name in ("zipf", "zipf_scan", "chat")},
                         "targets": {"every_policy_decisions_per_s_min": Each(N), "lru_speedup_vs_cachetools_min": N,
                                     "exact_vs_libcachesim": bool}}),
    "multiturn.py": ((), {"workload": {"chat": dict}, "topologies": Each({"tiers": [dict]}),
                          "runs": [{"name": str, "totals": SIMULATION, "transfer_ms_per_block": Each(N)}],
                          "oracle": {"by_capacity": Each({"capacity_blocks": N, "prefill_saved_share": N}),
                                     "capacity_of_run": Each(str), "policy_alone_saved_share": Each(N),
                                     "check": {"capacity_blocks": int, "ours_miss_ratio": N,
                                               "libcachesim_belady_miss_ratio": N}}}),
    "remote.py": ((), {"info": {"redis_server": str, "load_average_start": LOAD, "runtime_s": N},
                       "redis": [REDIS_ROW],
                       "value_check": [{"size": str, "xxh3_hot_gbps": N, "xxh3_cold_gbps": N, "mac_gbps": N}]}),
    "file_tier.py": (("--dir", "{tmp}"), {"info": {"filesystem": str, "runs": int, "load_average_start": LOAD},
                                          "rows": [FILE_ROW]}),
    "sync.py": ((), {"rows": {name: LATENCY for name in SYNC_READS},
                     "runs": Each([LATENCY]), "refreshed": int, "batch": int, "block_bytes": int, "runs_count": int}),
    "gpu_connector.py": (("--device", "cpu"), {"device": str, "shape": dict, "layouts": {
        "pairs": int, "all_equal": bool, "unequal": list, "unpinned_engines": int, "failed_jobs": int},
        "rows": [{"section": str, "layout": str, "direction": str, "gbps": N, "ceiling_gbps": N, "ratio": N,
                  "jobs_ok": bool}], "pageable_rows": [dict], "tp2": {"scopes": [str], "all_equal": bool},
        "hybrid": {"all_equal": bool, "reported_while_in_flight": list},
        "injected": Each({"caught": bool}), "checks": Each(bool), "passed": bool}),
    "swap.py": ((), {"device": str, "layout": dict, "engine": list, "rows": [{
        "memory": str, "blocks": int, "path": str, "direction": str, "gb_per_s": N, "contiguous_gb_per_s": N,
        "ratio": N}]}),
    "queues.py": ((), {"simulated_remote": dict, "layout": dict, "step_overhead": [{
        "matrix": int, "step_ms_without_stores": N, "step_ms_with_stores": N, "overhead": N,
        "blocks_written_remote": int, "stores_dropped": int}],
        **{name: {"p50_ms": N, "p95_ms": N, "p99_ms": N, "stores_dropped": int, "put_calls": int}
           for name in ("loads_alone", "loads_under_storm")}}),
    "cost_model.py": ((), {"engine_prefill_tokens_per_s": N, "remote": dict, "runs": {
        "cost model off": COST_RUN, "cost model on": COST_RUN, "on, round trip recovers": RECOVERY_RUN,
        "on, link recovers": RECOVERY_RUN}}),
    "mrc.py": ((), {"multiples": [N], "traces": {name: MRC_TRACE for name in (
        "zipf0.9_wide", "zipf0.8_hot", "zipf0.8_small", "zipf1.0_small", "zipf0.9_scans_small")},
        "ns_per_access": Each(Each(N)), "fraction_of_lru_decision": Each(Each(N)), "seeds": int, "repeat": int}),
    "events.py": ((), {"calls": int, "repeat": int, "events_per_s_published": N, "sink_stats": dict,
                       **{name: {"deque_append": N, "stored_64_blocks": N, "removed_1_block": N}
                          for name in ("us_per_call", "ratio_to_deque_append")}}),
    "manager_events.py": ((), {"requests": int, "repeat": int, "load": LOAD, "calls": {
        call: {"us_events_off": N, "us_events_on": N, "added_us": N} for call in ("allocate", "store")}}),
    "hybrid_state.py": ((), {"block_size": int, "layers": int, "runs": int, "rows": [{
        "family": str, "prompt_tokens": int, "recompute_ms": N, "floor_ms": N, "chunked_ms": N, "miss_ms": N,
        "hit_gpu_ms": N, "miss_vs_chunked": N,
        "hit_cpu_ms": N, "hit_gpu_ms_runs": [N], "reused_tokens": int, "reused_from_cpu": int, "states_saved": int,
        "state_bytes": int, "state_pages": int, "kv_block_bytes": int, "max_logit_diff": N, "same_token": bool,
        "miss_vs_recompute": N, "hit_vs_recompute": N, "hit_vs_floor": N}]}),
    "model_identity.py": ((), {"cold_cache_dropped": bool, "rows": [{
        "checkpoint_bytes": int, "tensors": int, "cold_s": (*N, type(None)), "warm_s": N, "memoized_s": N,
        "in_memory_s": N, "full_read_s": N, "ratio_to_full_read": N, "meets_target": bool}]}),
    "replay_flood.py": ((), {"kept": int, "requests": int, "clients": int,
                             "phases": {name: FLOOD_PHASE for name in ("baseline", "flood", "after")},
                             "flood_vs_baseline": {"published_per_s": N, "api_max": N},
                             "live_during_flood": {"received": int, "longest_gap_ms": N},
                             "flood_client": {"replayed": int, "answered": int, "full_replays": int},
                             "clear_s": N, "sink_stats": dict}),
}
"""Per benchmark run here: its options besides ``--quick --out`` (``{tmp}``: a scratch folder), and its JSON's shape."""


def benchmark_scripts() -> set[str]:
    """Every script in ``benchmarks/`` but the shared modules."""
    return {path.name for path in BENCHMARKS.glob("*.py")} - HELPERS


def test_every_benchmark_has_one_quick_test() -> None:
    assert not set(QUICK_RUNS) & set(ENGINE_RUNS), "a benchmark run here and in an engine's suite"
    untested = benchmark_scripts() - set(QUICK_RUNS) - set(ENGINE_RUNS)
    assert not untested, f"benchmarks without a quick test: {sorted(untested)} (add them to QUICK_RUNS or ENGINE_RUNS)"
    gone = (set(QUICK_RUNS) | set(ENGINE_RUNS)) - benchmark_scripts()
    assert not gone, f"quick tests of scripts that are not in benchmarks/: {sorted(gone)}"
    runs = {script: [] for script in ENGINE_RUNS}
    for test in TESTS.rglob("test_*.py"):
        for script in re.findall(r'run_quick\(\s*"(\w+\.py)"', test.read_text()):
            runs.setdefault(script, []).append(test.relative_to(TESTS).as_posix())
    assert runs == {script: [test] for script, test in ENGINE_RUNS.items()}, "each engine benchmark: one test"


def test_shared_modules_are_not_benchmarks() -> None:
    for name in sorted(HELPERS):
        assert "__main__" not in (BENCHMARKS / name).read_text(), f"{name} runs as a script: give it a quick test"


def test_committed_results_come_from_full_runs() -> None:
    for path in sorted(BENCHMARKS.glob("*.json")):
        assert json.loads(path.read_text()).get("quick") is not True, f"{path.name} is a --quick run's"


@pytest.mark.parametrize("script", sorted(QUICK_RUNS))
def test_quick_run_writes_its_json(script: str, tmp_path: Path) -> None:
    extra, shape = QUICK_RUNS[script]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    document = run_quick(script, tmp_path, *(arg.format(tmp=scratch) for arg in extra))
    assert_shape(document, shape)
    if script == "remote.py":
        assert {row["target"] for row in document["redis"]} == {"single", "cluster x3"}
        assert_shape([row for row in document["redis"] if row["target"] == "single"], [LOOP_COLUMNS])
    if script == "file_tier.py":
        assert_shape([row for row in document["rows"] if row["op"] == "GET"], [FILE_GET_COLUMNS])
        assert not any(scratch.iterdir()), "the file tier's data left behind"
    if script == "multiturn.py":
        assert sorted(path.name for path in tmp_path.glob("*.png")) == ["multiturn_hit_ratio.png", "multiturn_ttft.png"]
