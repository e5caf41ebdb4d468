"""What prose in the repository points at, and whether it is there: paths, module names, docs pages, sections.

Read by the checks of README and docs/ (``tests/docs/test_docs_examples.py``) and of the code's docstrings and
comments (``tests/docs/test_code_references.py``). A path or module name counts when backticked; a page of
docs/ counts written out as ``docs/<page>.md``, followed by ``#anchor`` or ``, "Section"`` to name a part of it.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from support import REPO

TOP_FOLDERS = ("tiercache", "tiers", "policies", "configs", "examples", "scripts", "benchmarks", "docs", "tests")
PATH_SPAN = re.compile(rf"`((?:{'|'.join(TOP_FOLDERS)})/[\w./-]*)`")
NAME_SPAN = re.compile(r"`(tiercache(?:\.\w+)+)`")
PAGE_REFERENCE = re.compile(r'\bdocs/([\w-]+\.md)(?:#([\w-]+)|,\s+"([^"]+)")?')
"""``docs/<page>.md``, optionally with ``#anchor`` (a heading's) or ``, "Section"`` (a heading or a bold lead-in)."""
HEADING = re.compile(r"^#+ (.+)$", flags=re.MULTILINE)
BOLD_LEAD = re.compile(r"^(?:[-*] )?\*\*([^*]+?)\.?\*\*", flags=re.MULTILINE)
"""A paragraph or list item that opens with a bold title (``**Entry state.** ...``): a section of its page."""
PACKAGE_DIRS = {"tiercache.tiers": "tiers", "tiercache.policies": "policies", "tiercache.configs": "configs"}
"""Where the build's ``package-dir`` mapping takes these packages from."""


def module_source(module: str) -> Path | None:
    """The source file of a module or package of this checkout (found as the build's ``package-dir`` maps it)."""
    for package, folder in {**PACKAGE_DIRS, "tiercache": "tiercache"}.items():
        if module == package or module.startswith(package + "."):
            path = REPO / folder / Path(*module.removeprefix(package).lstrip(".").split("."))
            source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            return source if source.exists() else None
    return None


def names_something(dotted: str) -> bool:
    """Whether a dotted ``tiercache`` name is a module of this checkout, or a name the module before its last dot
    has."""
    if module_source(dotted) is not None:
        return True
    module, _, name = dotted.rpartition(".")
    source = module_source(module)
    return source is not None and re.search(rf"\b{name}\b", source.read_text()) is not None


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in HEADING.findall(path.read_text())}


@cache
def sections(page: str) -> frozenset[str]:
    """The parts of ``docs/<page>`` a reference may name: its headings and its paragraphs' bold titles."""
    text = (REPO / "docs" / page).read_text()
    return frozenset(" ".join(title.split()) for title in HEADING.findall(text) + BOLD_LEAD.findall(text))


def missing_paths_and_names(text: str) -> list[str]:
    """The backticked repository paths that are not in this checkout and the module names that name nothing."""
    missing = [f"`{path}` is not here" for path in PATH_SPAN.findall(text) if not (REPO / path).exists()]
    return missing + [f"`{name}` names nothing" for name in NAME_SPAN.findall(text) if not names_something(name)]


def broken_page_references(text: str) -> list[str]:
    """The ``docs/<page>.md`` references to a page, an anchor or a section that does not exist."""
    broken = []
    for page, anchor, section in PAGE_REFERENCE.findall(text):
        path = REPO / "docs" / page
        title = " ".join(section.split())
        if not path.exists():
            broken.append(f"docs/{page} is not a page")
        elif anchor and anchor not in anchors(path):
            broken.append(f"docs/{page}#{anchor} names no heading")
        elif title and title not in sections(page):
            broken.append(f'docs/{page}, "{title}" names no section (heading or bold title)')
    return broken
