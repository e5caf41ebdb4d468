"""``benchmarks/restart_rows.py --quick`` runs the restart rows alone (a writer, a fresh reader over Redis, a server
without the connector) for the small Llama and writes its JSON, its ceiling read after idle and right after another."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, RESTART_RUN, assert_shape, run_quick


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("restart_rows.py", tmp_path, "--model-dir", str(tmp_path / "model"))
    assert_shape(document, {"restart": {"llama": {"runs": [RESTART_RUN], "restart_over_local_median": NUMBER,
                                                  "floor_over_local_median": NUMBER}}})
    run = document["restart"]["llama"]["runs"][0]
    assert run["answers_equal"] and run["external_tokens"] > 0, "the fresh server loaded from Redis, same answers"
    assert run["raw_read_ms"] > 0 and run["raw_read_hot_ms"] > 0, "the ceiling read the writer's values back"
