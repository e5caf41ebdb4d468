"""WrittenKeys step by step: what each remote lane is known to hold, bounded by recency of sighting."""

from __future__ import annotations

from tiercache.bookkeeping.written_keys import WrittenKeys


def test_the_least_recently_seen_key_is_forgotten_first() -> None:
    written = WrittenKeys(lanes=1, remember=2)
    written.landed(0, [b"a", b"b"])
    written.landed(0, [b"a"])  # seen again: now the most recent
    written.landed(0, [b"c"])
    assert [written.holds(0, key) for key in (b"a", b"b", b"c")] == [True, False, True]


def test_a_not_held_answer_is_stale_for_a_key_seen_since() -> None:
    written = WrittenKeys(lanes=2, remember=8)
    written.landed(0, [b"a"])
    clock = written.landings
    assert not written.landed_since(0, b"a", clock)
    written.landed(1, [b"a"])
    assert not written.landed_since(0, b"a", clock), "a sighting in another lane says nothing of this one"
    written.landed(0, [b"a"])
    assert written.landed_since(0, b"a", clock)
    written.forget(0, [b"a"])
    assert not written.holds(0, b"a") and not written.landed_since(0, b"a", clock)
