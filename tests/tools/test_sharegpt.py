"""The ShareGPT reader: element by element up to the cut, a conversation's leading question-answer turns."""

from __future__ import annotations

import json
from pathlib import Path

from tiercache.tools.sharegpt import Exchange, raw_elements, read_conversations, sharegpt_path

CUT_FILE_MIN_CONVERSATIONS = 10_000
"""The shipped file, cut off at 125 MB, still holds more than this many conversations."""


def element(conversation_id: str, *messages: tuple[str, str]) -> dict[str, object]:
    return {"id": conversation_id, "conversations": [{"from": who, "value": text} for who, text in messages]}


def test_elements_are_read_up_to_the_cut(tmp_path: Path) -> None:
    whole = [element("a", ("human", "hi"), ("gpt", "hello")), element("b", ("human", "why?"), ("gpt", "because"))]
    text = json.dumps([*whole, element("c", ("human", "cut here"), ("gpt", "never read"))])
    cut = text[: text.index("cut here") + 3]
    assert list(raw_elements(cut)) == whole
    assert list(raw_elements(text))[-1]["id"] == "c"  # an intact file is read to its end
    path = tmp_path / "cut.json"
    path.write_text(cut)
    assert [c.id for c in read_conversations(path)] == ["a", "b"]


def test_a_conversation_keeps_its_leading_question_answer_turns(tmp_path: Path) -> None:
    rows = [
        element("regular", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "unanswered")),
        element("gpt-first", ("gpt", "hello"), ("human", "q")),
        element("empty-answer", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "  ")),
        element("two-humans", ("human", "q1"), ("human", "q1 again"), ("gpt", "a")),
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    found = {c.id: c.exchanges for c in read_conversations(path)}
    assert found == {"regular": (Exchange("q1", "a1"), Exchange("q2", "a2")), "empty-answer": (Exchange("q1", "a1"),)}


def test_the_installed_file_is_cut_and_still_holds_thousands_of_conversations() -> None:
    path = sharegpt_path()
    try:
        json.loads(path.read_text(encoding="utf-8"))
        cut = False
    except json.JSONDecodeError:
        cut = True
    assert cut, "the shipped file parses whole now: the reader's reason to exist is gone"
    conversations = list(read_conversations())
    assert len(conversations) > CUT_FILE_MIN_CONVERSATIONS
    assert all(c.exchanges and all(e.question.strip() and e.answer.strip() for e in c.exchanges)
               for c in conversations)
    assert sum(len(c.exchanges) > 1 for c in conversations) > CUT_FILE_MIN_CONVERSATIONS // 2
