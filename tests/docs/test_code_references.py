"""What the prose that ships points at is there: repository paths, module names, docs pages and sections.

The prose read: every ``.py`` file of the code folders (its docstrings, every string that stands alone as a
statement, attribute docstrings included, and its comments), the comments of the YAML topologies under
configs/, and the Markdown that ships (README.md and docs/*.md, paragraph by paragraph). A backticked path must
be in this checkout, a backticked ``tiercache`` name must name a module or a name in it, and a
``docs/<page>.md`` reference must name a page, and the heading or bold title it cites
(``docs/architecture.md, "Entry state"``). The design is docs/architecture.md: a citation of any other design
document fails, wherever it stands.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from support import REPO
from support.doc_references import broken_page_references, missing_paths_and_names

CODE_FOLDERS = ("tiercache", "tiers", "policies", "benchmarks", "examples", "scripts", "tests")
RETIRED_DESIGN = re.compile(r"\bDESIGN\b")
"""The design document the code once cited, which the repository does not have."""
YAML_COMMENT = re.compile(r"""^(?:[^'"#]|'[^']*'|"[^"]*")*?(?:^|\s)#(.*)$""")
"""A YAML line's comment: a ``#`` at the line's start or after a space, outside quotes."""

Prose = Iterable[tuple[int, str]]
"""Pieces of prose, each with the line it starts on."""


def python_prose(source: str) -> Iterator[tuple[int, str]]:
    """The docstrings and comments of a module's source, each with the line it starts on."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def yaml_prose(source: str) -> Iterator[tuple[int, str]]:
    """A YAML file's comments: each run of whole-line comments as one piece (a reference may wrap), each comment
    after a value on its own."""
    run: list[str] = []
    start = 0
    for number, line in enumerate(source.splitlines(), start=1):
        whole = line.lstrip().startswith("#")
        if run and not whole:
            yield start, " ".join(run)
            run = []
        match = YAML_COMMENT.match(line)
        if match is None:
            continue
        if not whole:
            yield number, match.group(1)
            continue
        start = start if run else number
        run.append(line.lstrip().removeprefix("#").strip())
    if run:
        yield start, " ".join(run)


def markdown_prose(source: str) -> Iterator[tuple[int, str]]:
    """A Markdown page's paragraphs (blocks between blank lines), each with the line it starts on."""
    start, lines = 1, []
    for number, line in enumerate(source.splitlines(), start=1):
        if line.strip():
            start = start if lines else number
            lines.append(line)
        elif lines:
            yield start, "\n".join(lines)
            lines = []
    if lines:
        yield start, "\n".join(lines)


def problems_in(where: str, pieces: Prose) -> list[str]:
    """What the prose of ``where`` (its ``pieces``) points at that is not there."""
    problems = []
    for line, text in pieces:
        found = missing_paths_and_names(text) + broken_page_references(text)
        if RETIRED_DESIGN.search(text):
            found.append("cites DESIGN, which is not in the repository (the design is docs/architecture.md)")
        problems += [f"{where}:{line}: {problem}" for problem in found]
    return problems


SOURCES = sorted(path for folder in CODE_FOLDERS for path in (REPO / folder).rglob("*.py"))
TOPOLOGIES = sorted(path for pattern in ("*.yaml", "*.yml") for path in (REPO / "configs").rglob(pattern))
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def problems_of(paths: list[Path], check: Callable[[str, str], list[str]]) -> list[str]:
    return [problem for path in paths for problem in check(path.relative_to(REPO).as_posix(), path.read_text())]


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_docstrings_and_comments_point_at_what_is_there(folder: str) -> None:
    sources = [path for path in SOURCES if path.is_relative_to(REPO / folder)]
    problems = problems_of(sources, lambda where, source: problems_in(where, python_prose(source)))
    assert not problems, "\n".join(problems)


def test_the_topologies_comments_point_at_what_is_there() -> None:
    assert TOPOLOGIES, "no YAML under configs/"
    problems = problems_of(TOPOLOGIES, lambda where, source: problems_in(where, yaml_prose(source)))
    assert not problems, "\n".join(problems)


def test_the_pages_point_at_what_is_there() -> None:
    problems = problems_of(PAGES, lambda where, source: problems_in(where, markdown_prose(source)))
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
    (problem,) = problems_in("example.py", python_prose(text))
    line = 2 if text.startswith("x = 1") else 1
    assert complaint in problem and problem.startswith(f"example.py:{line}: "), problem


YAML, MARKDOWN = ("configs/example.yaml", yaml_prose), ("docs/example.md", markdown_prose)


@pytest.mark.parametrize(
    ("kind", "text", "line", "complaint"),
    [
        (YAML, "# A topology (DESIGN.md, \"Hierarchy\").\ntiers: []\n", 1, "cites DESIGN"),
        (YAML, "model:\n  id: x  # as DESIGN says\n", 2, "cites DESIGN"),
        (YAML, "a: 1\n# (docs/architecture.md, \"Central\n# and regional drift\").\n", 2, "names no section"),
        (YAML, "# see `configs/no_such.yaml`\n", 1, "is not here"),
        (MARKDOWN, "# Title\n\nAs DESIGN.md says.\n", 3, "cites DESIGN"),
        (MARKDOWN, "# Title\n\nSee docs/architecture.md,\n\"No such section\".\n", 3, "names no section"),
        (MARKDOWN, "Intro.\n\nSee docs/no-such-page.md.\n", 3, "is not a page"),
    ],
)
def test_a_broken_reference_in_a_topology_or_a_page_fails(
    kind: tuple[str, Callable[[str], Prose]], text: str, line: int, complaint: str
) -> None:
    """YAML comments (a reference wrapped over comment lines too) and Markdown paragraphs are read, and a broken
    reference is reported with the line its comment or paragraph starts on."""
    where, read = kind
    (problem,) = problems_in(where, read(text))
    assert complaint in problem and problem.startswith(f"{where}:{line}: "), problem


def test_a_yaml_hash_inside_quotes_or_a_value_is_no_comment() -> None:
    text = 'url: "redis://host/0#DESIGN"\nkey: a#DESIGN\nname: \'DESIGN # x\'  # docs/architecture.md, "Hierarchy"\n'
    assert list(yaml_prose(text)) == [(3, ' docs/architecture.md, "Hierarchy"')]
    assert problems_in("configs/example.yaml", yaml_prose(text)) == []


def test_working_references_pass() -> None:
    """What the code does write: a section as a bold title or a heading, an anchor, a module's name."""
    text = (
        'docs/architecture.md, "Entry state"; docs/benchmarks.md, "Redis\n    tier"; docs/operations.md; '
        "docs/architecture.md#the-map; ``tiers/base.py``; ``tiercache.movement.presence.PresenceCache``"
    )
    assert missing_paths_and_names(text) + broken_page_references(text) == []

