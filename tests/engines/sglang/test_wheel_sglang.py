"""tiercache's wheel under SGLang 0.5.23: every SGLang module and README's ``module_path`` import from the
built wheel, installed over this venv's SGLang (tests/packaging/test_wheel.py leaves them to this suite)."""

from __future__ import annotations

from pathlib import Path

from support.wheel import engine_suite_imports, failures, wheel_file  # noqa: F401  (wheel_file: the session fixture)


def test_sglang_modules_import_from_the_wheel(wheel_file: Path, tmp_path: Path) -> None:  # noqa: F811
    report = engine_suite_imports("sglang", wheel_file, tmp_path)
    assert "tiercache.integrations.sglang.backend" in report["modules"]
    assert not failures(report)
