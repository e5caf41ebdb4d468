"""The presence cache step by step: what it keeps, for whom, and what it drops, through a LowerTiers' remote.

Real parts: a ``LowerTiers`` over a simulated remote whose presence checks the test holds and lets go
(``hold``/``unhold``), so each answer lands when the test says. The cache under test is the one the lookup asks.
"""

from __future__ import annotations

import time

from support.lower_tiers_helpers import WAIT_S, chain, lower_config, remote, simulated, started, store_name, until

from tiercache.manager.lower_tiers import LowerTiers
from tiercache.movement.presence import PresenceCache


def _tiers(opened: list[LowerTiers]) -> tuple[LowerTiers, PresenceCache]:
    tiers = started(lower_config(cpu_blocks=64, remotes=[simulated(store_name())]), opened)
    cache = tiers.parts.presence_cache
    assert cache is not None
    return tiers, cache


def test_answers_no_asker_keeps_are_bounded_oldest_first_and_kept_ones_never_dropped(
        opened: list[LowerTiers]) -> None:
    tiers, cache = _tiers(opened)
    cache.max_keys = 8
    remote(tiers).hold("contains")
    kept = chain(tiers, 4, salt=1)
    assert tiers.lookup(kept, asker="a") is None
    unkept = chain(tiers, 10, salt=2)
    assert tiers.lookup(unkept) is None  # no asker: remembered only until read, or bounded
    assert len(cache) == 8
    assert all(key in cache for key in kept), "a key an asker keeps was dropped by the bound"
    assert [key in cache for key in unkept] == [False] * 6 + [True] * 4, "not the oldest unkept keys dropped"
    more_kept = chain(tiers, 20, salt=3)
    assert tiers.lookup(more_kept, asker="b") is None
    assert len(cache) == 24 and all(key in cache for key in kept + more_kept), "the bound dropped kept keys"
    remote(tiers).unhold("contains")


def test_forget_drops_only_what_no_other_asker_keeps(opened: list[LowerTiers]) -> None:
    tiers, cache = _tiers(opened)
    shared, own = chain(tiers, 6, salt=1), chain(tiers, 9, salt=1)[6:]
    until(lambda: tiers.lookup(shared, asker="a"))
    until(lambda: tiers.lookup(shared + own, asker="b"))
    assert len(cache) == 9
    tiers.forget("b")
    assert len(cache) == 6 and all(key in cache for key in shared)
    tiers.forget("a")
    assert len(cache) == 0


def test_a_key_forgotten_in_flight_stays_until_read_then_goes(opened: list[LowerTiers]) -> None:
    tiers, cache = _tiers(opened)
    keys = chain(tiers, 3, salt=4)
    remote(tiers).hold("contains")
    assert tiers.lookup(keys, asker="a") is None
    tiers.forget("a")
    assert len(cache) == 3, "an answer in flight was dropped before it landed"
    remote(tiers).unhold("contains")
    hit = until(lambda: tiers.lookup(keys))
    assert hit.num_blocks == 0  # nothing stored anywhere: every key answered not held
    tiers.release(hit)
    assert len(cache) == 0, "an answer kept by no asker outlived its read"


def test_an_answer_lands_while_later_batches_stay_in_flight_and_the_signal_says_so(
        opened: list[LowerTiers]) -> None:
    tiers, cache = _tiers(opened)
    assert cache.answer_signal() is None, "nothing in flight, yet a signal to wait on"
    remote(tiers).hold("contains", allow=1)
    first, second = chain(tiers, 2, salt=5), chain(tiers, 2, salt=6)
    assert tiers.lookup(first, asker="a") is None
    assert tiers.lookup(second, asker="b") is None
    signal = cache.answer_signal()
    assert signal is not None and signal.wait(WAIT_S), "the first batch's answer never signalled"
    assert tiers.wait_for_answers(WAIT_S)
    hit = tiers.lookup(first, asker="a")
    assert hit is not None, "an answered batch waited behind one still in flight"
    tiers.release(hit)
    assert tiers.lookup(second, asker="b") is None and cache.busy
    remote(tiers).unhold("contains")
    hit = until(lambda: tiers.lookup(second, asker="b"))
    tiers.release(hit)
    assert not cache.busy and cache.answer_signal() is None


def test_a_batch_past_give_up_answers_could_not_tell_and_is_asked_again(opened: list[LowerTiers]) -> None:
    tiers, cache = _tiers(opened)
    keys = chain(tiers, 4, salt=7)
    remote(tiers).hold("contains")
    cache.give_up_s = 0.05
    assert tiers.lookup(keys, asker="a") is None
    time.sleep(2 * cache.give_up_s)
    hit = tiers.lookup(keys, asker="a")
    assert hit is not None and hit.num_blocks == 0, "a given-up check served something"
    tiers.release(hit)
    assert all(key not in cache for key in keys), "'could not tell' was kept"
    assert tiers.lookup(keys, asker="a") is None, "the next lookup did not ask again"
    remote(tiers).unhold("contains")


def test_lookups_that_do_not_send_share_one_batch_sent_at_the_flush(opened: list[LowerTiers]) -> None:
    tiers, cache = _tiers(opened)
    sim = remote(tiers)
    prompts = [chain(tiers, 3, salt=10 + request) for request in range(5)]
    for request, keys in enumerate(prompts):
        assert tiers.lookup(keys, asker=request, send=False) is None
    assert sim.calls["contains"] == 0 and cache.busy, "a lookup that does not send sent"
    tiers.flush_presence()
    for request, keys in enumerate(prompts):
        tiers.release(until(lambda request=request, keys=keys: tiers.lookup(keys, asker=request, send=False)))
    assert sim.calls["contains"] == 1, "a step's lookups were not sent as one batch"


def test_waiting_sends_what_lookups_queued(opened: list[LowerTiers]) -> None:
    tiers, _ = _tiers(opened)
    keys = chain(tiers, 2, salt=20)
    assert tiers.lookup(keys, asker="a", send=False) is None
    assert tiers.wait_for_answers(WAIT_S), "a wait found nothing in flight: the queued check was never sent"
    hit = tiers.lookup(keys, asker="a", send=False)
    assert hit is not None
    tiers.release(hit)
