"""tiercache's wheel under vLLM 0.33: every vLLM module (the connector's too) and README's module paths import
from the built wheel, installed over this venv's vLLM (tests/packaging/test_wheel.py leaves them to this suite)."""

from __future__ import annotations

from pathlib import Path

from support.wheel import engine_suite_imports, failures, wheel_file  # noqa: F401  (wheel_file: the session fixture)


def test_vllm_modules_import_from_the_wheel(wheel_file: Path, tmp_path: Path) -> None:  # noqa: F811
    report = engine_suite_imports("vllm", wheel_file, tmp_path)
    assert "tiercache.integrations.vllm.connector.connector" in report["modules"]
    assert not failures(report)
