"""tiercache's wheel, built from a copy of this checkout, installed into fresh venvs and imported there.

Every venv the suites run in installs tiercache editable, so only a built wheel shows a package the
build left out. ``wheel_file`` (a session fixture) builds it once per session. The main suite installs
it with its extras into a fresh venv (``fresh_venv``); an engine suite installs it ``--no-deps`` into a
venv layered over its engine venv's site-packages (``layered_venv``). ``import_modules`` imports modules
there, from outside the repository, with ``wheel_imports.py``. Which modules need an engine is derived
from the source tree (``engine_of``), and each engine's suite imports them (``ENGINE_SUITES``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ROOTS = {"tiercache": "tiercache", "tiers": "tiercache.tiers", "policies": "tiercache.policies",
         "configs": "tiercache.configs"}
"""Source folder -> the package it installs as (setup.py's mapping, seen from the other side)."""
ENGINE_PACKAGES = {"vllm": "tiercache.integrations.vllm", "sglang": "tiercache.integrations.sglang"}
"""An engine's integration package: every module in it is imported in that engine's venvs."""
TESTING_PACKAGE = "tiercache.testing"
"""Its modules that import an engine at import time belong to that engine too."""
ENGINE_SUITES = {"vllm": "vllm", "vllm_serve": "vllm", "sglang": "sglang"}
"""tests/engines/<suite>/ -> the engine its venv has; each has a ``test_wheel_<suite>.py``."""
TOP_LEVEL_ONLY = {".git", "build", "dist", ".whl"}
"""Not copied for the build when at the repository's top (a subpackage of one of these names is)."""
ANYWHERE = ("__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis")
"""Not copied for the build wherever they are (as the egg-info and the ``.venv*`` folders at the top)."""
PIP_QUIET = ("-q", "--disable-pip-version-check")
MODULE_PATH = re.compile(r"\b\w*module_path\"?\s*[:=]\s*\"([\w.]+)\"")
"""A ``kv_connector_module_path``/``module_path``/``cache_policy_module_path`` value in README.md (JSON or Python)."""


# ---- the source tree -----------------------------------------------------------------------
def module_name(path: Path) -> str:
    """``tiers/file/tier.py`` -> ``tiercache.tiers.file.tier`` (a path relative to the repository)."""
    root, *rest = path.with_suffix("").parts
    parts = [ROOTS[root], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    """Every ``.py`` file under the package roots, relative to the repository."""
    return sorted(p.relative_to(REPO) for root in ROOTS for p in (REPO / root).rglob("*.py")
                  if "__pycache__" not in p.parts)


def source_modules() -> list[str]:
    """Every module the source tree installs, except ``__main__`` (importing it runs the CLI)."""
    return [module_name(p) for p in source_files() if p.stem != "__main__"]


def _import_roots(tree: ast.Module) -> set[str]:
    """The top-level names a module imports when it is imported (not in functions or ``if TYPE_CHECKING``)."""
    roots: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return roots


def engine_of(module: str) -> str | None:
    """The engine a module needs at import: its integration package's, or one a testing module imports."""
    for engine, package in ENGINE_PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return engine
    if module.startswith(TESTING_PACKAGE + "."):
        (path,) = [p for p in source_files() if module_name(p) == module]
        roots = _import_roots(ast.parse((REPO / path).read_text()))
        return next((engine for engine in ENGINE_PACKAGES if engine in roots), None)
    return None


def engine_modules(engine: str) -> list[str]:
    """The modules only ``engine``'s venvs can import (and must)."""
    return [module for module in source_modules() if engine_of(module) == engine]


def readme_module_paths(engine: str) -> list[str]:
    """The ``*module_path`` values README.md gives for ``engine``'s integration."""
    found = set(MODULE_PATH.findall((REPO / "README.md").read_text()))
    package = ENGINE_PACKAGES[engine]
    return sorted(path for path in found if path == package or path.startswith(package + "."))


def installed_configs(root: Path) -> set[str]:
    """The YAML files under ``root``, relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*.yaml")}


# ---- building and installing ---------------------------------------------------------------
def _not_copied(folder: str, names: list[str]) -> set[str]:
    """``copytree``'s ignore: build outputs, caches and venvs, which could hide what the checkout lacks."""
    top = Path(folder).resolve() == REPO
    return {name for name in names
            if name in ANYWHERE or name.endswith(".egg-info")
            or (top and (name in TOP_LEVEL_ONLY or name.startswith(".venv")))}


def _build_isolation() -> list[str]:
    """``--no-build-isolation`` when this interpreter's setuptools meets pyproject's build requirement, else
    nothing (pip then installs it in an isolated build environment)."""
    requires = re.search(r"^requires = \[\"setuptools>=([\d.]+)\"\]$", (REPO / "pyproject.toml").read_text(), re.M)
    assert requires, "pyproject.toml's build-system requires setuptools>=N alone"
    try:
        found = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if _release(found) >= _release(requires[1]) else []


def _release(version: str) -> tuple[int, ...]:
    """``"84.2.1"`` -> ``(84, 2, 1)``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def run(command: list[str | Path], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with a clean environment (no PYTHON*/TIERCACHE_* settings); fail with its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TIERCACHE_", "VIRTUAL_ENV"))}
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_wheel(dest: Path) -> Path:
    """Build the wheel from a copy of the checkout (no stale ``build/`` or egg-info can hide a package)."""
    source = dest / "source"
    shutil.copytree(REPO, source, ignore=_not_copied)
    run([sys.executable, "-m", "pip", "wheel", *PIP_QUIET, "--no-deps", *_build_isolation(),
         "-w", dest / "dist", source], cwd=dest)
    (wheel,) = (dest / "dist").glob("tiercache-*.whl")
    return wheel


@pytest.fixture(scope="session")
def wheel_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiercache's wheel, built once per session from this checkout."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def pip_install(python: Path, *args: str | Path) -> None:
    """``pip install`` into the venv of ``python`` (with this interpreter's pip: the venv has none)."""
    run([sys.executable, "-m", "pip", "--python", python, "install", *PIP_QUIET, "--no-compile", *args])


def new_venv(path: Path) -> Path:
    """An empty venv (no pip) at ``path``; its python."""
    run([sys.executable, "-m", "venv", "--without-pip", path])
    return path / "bin" / "python"


def fresh_venv(path: Path, wheel: Path, extras: str, torch: str) -> Path:
    """A venv with ``torch`` (a requirement: the CPU build here) then the wheel with ``extras``; its python."""
    python = new_venv(path)
    pip_install(python, torch)
    pip_install(python, f"{wheel}[{extras}]")
    return python


def layered_venv(path: Path, wheel: Path) -> Path:
    """A venv with only the wheel (``--no-deps``) over this interpreter's site-packages; its python.

    Those are named in a ``.pth`` file, so their own ``.pth`` files (the editable tiercache's finder
    among them) are not processed there: tiercache comes from the wheel, everything else from here."""
    python = new_venv(path)
    pip_install(python, "--no-deps", wheel)
    engine_sites = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site_packages(python) / "engine-venv.pth").write_text("".join(f"{site}\n" for site in engine_sites))
    return python


def site_packages(python: Path) -> Path:
    """The venv's ``site-packages`` (its only one in these venvs)."""
    (found,) = python.parent.parent.glob("lib/python3*/site-packages")
    return found


def import_modules(python: Path, modules: list[str], cwd: Path) -> dict[str, Any]:
    """Import ``modules`` with ``python -I`` from ``cwd`` (outside the repository); ``wheel_imports.py``'s report."""
    assert not cwd.resolve().is_relative_to(REPO)
    out = cwd / "imports.json"
    run([python, "-I", Path(__file__).with_name("wheel_imports.py"), out, *modules], cwd=cwd)
    return json.loads(out.read_text())


def assert_from_wheel(report: dict[str, Any], python: Path) -> None:
    """tiercache's distribution, every module that imported and every tiercache module loaded are the venv's."""
    site = site_packages(python).resolve()
    assert Path(report["site_packages"]).resolve() == site
    assert Path(report["distribution"]).resolve() == site, report["distribution"]
    files = {name: Path(result["file"]).resolve() for name, result in report["modules"].items() if "file" in result}
    assert files
    files |= {name: Path(file).resolve() for name, file in report["loaded"].items() if file is not None}
    outside = {name: str(file) for name, file in files.items() if not file.is_relative_to(site / "tiercache")}
    assert not outside, f"loaded from outside {site}: {outside}"


def failures(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The modules that did not import, with why."""
    return {name: result for name, result in report["modules"].items() if "error" in result}


def engine_suite_imports(suite: str, wheel: Path, tmp_path: Path) -> dict[str, Any]:
    """An engine suite's check: its engine's modules and README's module paths, imported from ``wheel`` in a venv
    layered over this one (whose engine must import); the report, with every module loaded checked."""
    engine = ENGINE_SUITES[suite]
    readme = readme_module_paths(engine)
    assert readme, f"README.md names no {engine} module path"
    python = layered_venv(tmp_path / "venv", wheel)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    report = import_modules(python, [*engine_modules(engine), *readme], cwd)
    assert report["engines"][engine]
    assert_from_wheel(report, python)
    return report
