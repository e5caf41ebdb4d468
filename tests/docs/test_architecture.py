"""The layout is the architecture: the map in docs/architecture.md, each folder's ``__init__`` and the imports agree.

The map says, per folder, what it may import; each folder's ``__init__`` docstring
ends with the same rule ("Imports from: ..."); every import in every module of the
package (function-level and type-only ones too) follows it, so nothing imports
from a folder above it. And no two classes of the package share a name.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAP = REPO / "docs" / "architecture.md"
TOP_LEVEL = {"tiers": REPO / "tiers", "policies": REPO / "policies"}
"""Folders at the repository's top level, installed inside the ``tiercache`` namespace."""
TOP_MODULES = {"__init__", "__main__", "cli"}
"""The package's own modules above every folder: the public names and the command line."""


def folder_path(name: str) -> Path:
    return TOP_LEVEL.get(name, REPO / "tiercache" / name)


def map_rows() -> dict[str, set[str]]:
    """The map's table: folder name -> the folders it may import."""
    rows: dict[str, set[str]] = {}
    for line in MAP.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`(tiercache/)?\w+/`", cells[0]):
            continue
        name = cells[0].strip("`/").removeprefix("tiercache/")
        rows[name] = set(re.findall(r"`(\w+)`", cells[2]))
    return rows


def docstring_rule(name: str) -> set[str]:
    """The folders a folder's ``__init__`` docstring says it imports from."""
    doc = ast.get_docstring(ast.parse((folder_path(name) / "__init__.py").read_text())) or ""
    match = re.search(r"Imports from:(.*?)(?:\n\n|$)", doc, flags=re.DOTALL)
    assert match, f"{name}/__init__.py does not say what it imports from"
    rule = match.group(1)
    return set() if "nothing" in rule else set(re.findall(r"``(\w+)``", rule))


def folder_of(module: str, folders: set[str]) -> str | None:
    """The folder a ``tiercache.*`` module belongs to ('' for the package's own top modules), None outside."""
    parts = module.split(".")
    if parts[0] != "tiercache":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in folders else ""


def modules(name: str) -> list[Path]:
    return sorted(folder_path(name).rglob("*.py"))


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_the_map_covers_every_folder_of_the_package() -> None:
    folders = {p.name for p in (REPO / "tiercache").iterdir() if (p / "__init__.py").exists()}
    assert set(map_rows()) == folders | set(TOP_LEVEL)
    strays = {p.stem for p in (REPO / "tiercache").glob("*.py")} - TOP_MODULES
    assert not strays, f"modules outside any folder: {sorted(strays)}"


@pytest.mark.parametrize("name", sorted(map_rows()))
def test_each_folder_says_what_the_map_says(name: str) -> None:
    assert docstring_rule(name) == map_rows()[name], f"docs/architecture.md and {name}/__init__.py disagree"


@pytest.mark.parametrize("name", sorted(map_rows()))
def test_imports_follow_the_map(name: str) -> None:
    rows = map_rows()
    allowed = rows[name]
    wrong = []
    for path in modules(name):
        for line, module in imported(path):
            target = folder_of(module, set(rows))
            if target is None or target == name:
                continue
            if target not in allowed:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, "imports against the map:\n" + "\n".join(wrong)


def test_the_map_has_no_cycle() -> None:
    rows = map_rows()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for below in rows[name]:
                visit(below, (*path, name))
            done.add(name)

    for name in rows:
        visit(name, ())


def test_no_two_classes_share_a_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    files = list((REPO / "tiercache").rglob("*.py")) + [p for d in TOP_LEVEL.values() for p in d.rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"classes of one name: {shared}"
