"""What the code's docstrings and comments point at is there: repository paths, module names, docs pages and sections.

Every ``.py`` file of the code folders is read as text: its docstrings (every string that stands alone as a
statement, attribute docstrings included) and its comments. A backticked path must be in this checkout, a
backticked ``tiercache`` name must name a module or a name in it, and a ``docs/<page>.md`` reference must name a page,
and the heading or bold title it cites (``docs/architecture.md, "Entry state"``). The design is
docs/architecture.md: a citation of any other design document fails.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator

import pytest
from support import REPO
from support.doc_references import broken_page_references, missing_paths_and_names

CODE_FOLDERS = ("tiercache", "tiers", "policies", "benchmarks", "examples", "scripts", "tests")
RETIRED_DESIGN = re.compile(r"\bDESIGN\b")
"""The design document the code once cited, which the repository does not have."""


def prose(source: str) -> Iterator[tuple[int, str]]:
    """The docstrings and comments of a module's source, each with the line it starts on."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def problems_in(where: str, source: str) -> list[str]:
    """What the docstrings and comments of the module ``where`` (its ``source``) point at that is not there."""
    problems = []
    for line, text in prose(source):
        found = missing_paths_and_names(text) + broken_page_references(text)
        if RETIRED_DESIGN.search(text):
            found.append("cites DESIGN, which is not in the repository (the design is docs/architecture.md)")
        problems += [f"{where}:{line}: {problem}" for problem in found]
    return problems


SOURCES = sorted(path for folder in CODE_FOLDERS for path in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_docstrings_and_comments_point_at_what_is_there(folder: str) -> None:
    problems = [
        problem
        for path in SOURCES
        if path.is_relative_to(REPO / folder)
        for problem in problems_in(path.relative_to(REPO).as_posix(), path.read_text())
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('"""As DESIGN says."""', "cites DESIGN"),
        ('"""See ``tiercache/no_such_module.py``."""', "is not here"),
        ('"""See ``tiercache.movement.no_such_module``."""', "names nothing"),
        ("# docs/no-such-page.md", "is not a page"),
        ('x = 1\n"""docs/architecture.md, "No such section"."""', "names no section"),
        ('"""docs/architecture.md#no-such-heading"""', "names no heading"),
    ],
)
def test_each_kind_of_broken_reference_fails(text: str, complaint: str) -> None:
    """The check is not vacuous: a module with one broken reference of each kind is reported, with its line."""
    (problem,) = problems_in("example.py", text)
    line = 2 if text.startswith("x = 1") else 1
    assert complaint in problem and problem.startswith(f"example.py:{line}: "), problem


def test_working_references_pass() -> None:
    """What the code does write: a section as a bold title or a heading, an anchor, a module's name."""
    text = (
        'docs/architecture.md, "Entry state"; docs/benchmarks.md, "Redis\n    tier"; docs/operations.md; '
        "docs/architecture.md#the-map; ``tiers/base.py``; ``tiercache.movement.presence.PresenceCache``"
    )
    assert missing_paths_and_names(text) + broken_page_references(text) == []

