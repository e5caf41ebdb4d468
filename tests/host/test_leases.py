"""The leases an engine holds on the host server, step by step."""

from __future__ import annotations

from tiercache.host.leases import Leases


def test_a_hit_is_taken_once_and_only_by_its_id() -> None:
    leases: Leases[str, str] = Leases()
    first, second = leases.add_hit("a"), leases.add_hit("b")
    assert first != second
    assert leases.take_hit(second) == "b"
    assert leases.take_hit(second) is None, "fetched or released already"
    assert leases.take_hit(999) is None, "not this engine's"
    assert leases.counts()["hits"] == 1


def test_only_the_writes_given_end_and_each_once() -> None:
    leases: Leases[str, str] = Leases()
    leases.begin_writes([b"k1", b"k2", b"k3"], [4, None, 6])
    ended = leases.end_writes([b"k1", b"k2", b"k3", b"k9"], [4, 5, 7, 1], [True, True, True, False])
    assert ended == ([b"k1"], [4], [True]), "k2 was given no slot, k3 another slot, k9 nothing"
    assert leases.end_writes([b"k1"], [4], [True]) == ([], [], [])
    assert leases.counts()["writes"] == 1, "k3 into slot 6 is still leased"


def test_drain_hands_back_everything_left_and_leaves_nothing() -> None:
    leases: Leases[str, str] = Leases()
    leases.add_hit("hit")
    fetch_id = leases.add_fetch("fetch")
    leases.add_fetch("released")
    leases.take_fetch(fetch_id + 1)
    leases.begin_writes([b"k1", b"k2"], [3, 8])
    leases.end_writes([b"k2"], [8], [True])
    leases.asked("request-1")
    leases.asked("request-2")
    leases.forgot("request-2")
    left = leases.drain()
    assert (left.hits, left.fetches, left.write_keys, left.write_slots, left.askers) == (
        ["hit"], ["fetch"], [b"k1"], [3], ["request-1"])
    assert leases.counts() == {"hits": 0, "fetches": 0, "writes": 0, "askers": 0}
    assert leases.drain().hits == []
