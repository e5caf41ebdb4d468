"""tiercache's wheel under vLLM 0.32's CPU build: the connector (README's ``kv_connector_module_path``) and every
other vLLM module imports from the built wheel, installed over this venv's vLLM, but the parts written for 0.33
only, which refuse this release by name (tests/engines/vllm/ imports those under 0.33)."""

from __future__ import annotations

from pathlib import Path

from support.wheel import (
    engine_suite_imports,
    failures,
    readme_module_paths,
    wheel_file,  # noqa: F401  (the session fixture)
)

from tiercache.integrations.vllm.version import CONNECTOR_SERIES, TIERING_SERIES, installed_vllm


def test_connector_imports_from_the_wheel(wheel_file: Path, tmp_path: Path) -> None:  # noqa: F811
    version = installed_vllm()
    assert version is not None and version.startswith(CONNECTOR_SERIES) and not version.startswith(TIERING_SERIES)
    report = engine_suite_imports("vllm_serve", wheel_file, tmp_path)
    refused = failures(report)
    tiering_only = "supports " + " or ".join(f"{series}x" for series in TIERING_SERIES) + " only"
    for module, why in refused.items():
        assert why["error"] == "UnsupportedVllmError" and tiering_only in why["message"], f"{module}: {why}"
    assert not {m for m in report["modules"] if m.startswith("tiercache.integrations.vllm.connector")} & set(refused)
    assert not set(readme_module_paths("vllm")) & set(refused)
    assert (Path(__file__).parents[1] / "vllm" / "test_wheel_vllm.py").is_file()  # where the refused ones import
