"""The documentation pages' fenced code blocks, as the docs tests read them (``tests/docs``).

Each block follows an HTML comment that says what happens to it (``example``,
``engine``, ``not run``; tests/docs/test_docs_examples.py says the rules);
``example(name)`` is the one block marked ``example: name`` and ``run(name)``
executes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.config import TierCacheConfig, config_from_dict

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENGINE_PAGE = REPO / "docs" / "engines.md"
"""Where the engine suites (``tests/*/{vllm,sglang}/test_*_readme.py``) read their configurations."""
ENGINE_CONFIGS = {
    "vllm": (r"--kv-transfer-config '(\{\s*\"kv_connector\": \"OffloadingConnector\".*?\})'", 3, 3),
    "vllm-connector": (r"--kv-transfer-config '(\{\"kv_connector\":\"TierCacheConnector\"(?:(?!\"host\":).)*?\})'",
                       3, 4),
    "vllm-connector-host": (r"--kv-transfer-config '(\{\"kv_connector\":\"TierCacheConnector\"[^']*?\"host\":[^']*\})'",
                            1, 1),
    "sglang": (r"--hicache-storage-backend-extra-config '(\{.*?\})'", 2, 2),
}
"""Per engine: the pattern its suite extracts a configuration with, how many configurations it expects,
and how many blocks docs/engines.md marks for it (the connector's fourth is the ``LLM(...)`` form; its line on
a host cache server is read by tests/engines/vllm_serve/test_host_served.py)."""
MARK = re.compile(r"<!-- (example|engine|not run): (.+?) -->")
FENCE = re.compile(r"```(\S*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    """One fenced code block and the mark before it."""

    page: str
    line: int
    lang: str
    kind: str
    """``example``, ``engine``, ``not run``, or ``""`` when the block is unmarked."""
    label: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks, and what is wrong with its code blocks (unfenced, unclosed, ``~~~``)."""
    lines, page = path.read_text().splitlines(), path.relative_to(REPO).as_posix()
    blocks: list[Block] = []
    problems: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        opened = FENCE.fullmatch(line)
        if line.startswith("~~~"):
            problems.append(f"{page}:{index + 1}: a ~~~ fence (use ```)")
        elif opened:
            end = next((i for i in range(index + 1, len(lines)) if lines[i] == "```"), None)
            if end is None:
                problems.append(f"{page}:{index + 1}: a fence never closed")
                break
            mark = MARK.fullmatch(lines[index - 1]) if index else None
            kind, label = (mark.group(1), mark.group(2)) if mark else ("", "")
            text = "\n".join(lines[index + 1 : end]) + "\n"
            blocks.append(Block(page, index + 1, opened.group(1), kind, label, text))
            index = end
        elif line.startswith(("    ", "\t")) and index and not lines[index - 1].strip() and line.strip():
            problems.append(f"{page}:{index + 1}: an indented code block (fence it and mark it)")
        index += 1
    return blocks, problems


BLOCKS = [block for path in PAGES for block in parse(path)[0]]


def example(name: str) -> str:
    """The text of the one block marked ``<!-- example: name -->``."""
    found = [block for block in BLOCKS if block.kind == "example" and block.label == name]
    assert len(found) == 1, f"{len(found)} blocks are marked 'example: {name}'"
    return found[0].text


def run(name: str, **names: Any) -> dict[str, Any]:
    """Execute the Python example ``name`` in a fresh namespace (plus ``names``); that namespace after."""
    namespace: dict[str, Any] = {"__name__": f"docs_example_{name}", **names}
    exec(compile(example(name), f"<example {name}>", "exec"), namespace)
    return namespace


def load_topology(data: Any, environ: dict[str, str] | None = None) -> TierCacheConfig:
    """A topology from a mapping, validated as a file would be (environment overrides only from ``environ``)."""
    return config_from_dict(data, source="<docs example>", environ=environ or {})
