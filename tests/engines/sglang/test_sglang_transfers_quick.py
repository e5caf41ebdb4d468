"""``benchmarks/sglang_transfers.py --quick`` runs under SGLang 0.5.23 and writes its JSON (listed in
tests/benchmarks/test_quick.py)."""

from __future__ import annotations

from pathlib import Path

from support.benchmark_runs import NUMBER, assert_shape, run_quick

OPERATION = {"adapter_ms": NUMBER, "ceiling_ms": NUMBER, "adapter_gbps": NUMBER, "ceiling_gbps": NUMBER,
             "adapter_vs_ceiling": NUMBER}
RESULT = {"layout": str, "pages": int, "page_bytes": int, "blocks_per_page": int,
          "operations": {name: OPERATION for name in ("set", "get", "exists")}}


def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    document = run_quick("sglang_transfers.py", tmp_path)
    assert_shape(document, {"repetitions": int, "load_average": {"before": [NUMBER], "after": [NUMBER]},
                            "results": [RESULT]})
    assert sorted(result["layout"] for result in document["results"]) == ["layer_first", "page_first"]
