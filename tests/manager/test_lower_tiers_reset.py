"""``LowerTiers.reset_cpu_tier`` (vLLM's ``reset_cache``): what nothing holds leaves the CPU tier, the rest stays valid.

Real parts only: the CPU tier, the simulated remote (its ``hold`` control keeps a put in
flight) and a real Redis. The test plays the engine, as in test_lower_tiers.
"""

from __future__ import annotations

import binascii
import threading

import redis
from support.lower_tiers_helpers import (
    LAYOUT,
    block_bytes,
    chain,
    cpu_occupancy,
    held_slots,
    lower_config,
    remote,
    settled_lookup,
    simulated,
    slot_bytes,
    started,
    store_name,
    stored,
    until,
    write,
)

from tiercache.config import config_from_dict
from tiercache.manager.lower_tiers import HostFetch, LowerTiers
from tiercache.telemetry.events.wire import BlockRemoved, KVEventBatch, block_hashes
from tiercache.testing.redis_servers import RedisServer


def fetched_bytes(tiers: LowerTiers, fetch: HostFetch) -> list[bytes]:
    until(fetch.ready)
    return [slot_bytes(tiers, slot) for slot in fetch.slots()]


def cpu_misses(tiers: LowerTiers, keys: list[bytes]) -> bool:
    """Whether the CPU tier holds none of ``keys``' prefix (a local lookup, released)."""
    hit = tiers.lookup(keys, local_only=True)
    assert hit is not None
    tiers.release(hit)
    return hit.num_blocks == 0


def test_reset_drops_every_block_reports_each_removed_and_frees_the_slots_for_new_writes(
    opened: list[LowerTiers],
) -> None:
    data = {"model": {"id": "lower-tiers"}, "layout": LAYOUT, "events": {"enabled": True},
            "tiers": [{"type": "cpu", "capacity_blocks": 4}]}
    tiers = started(config_from_dict(data, environ={}, engine_pool=True), opened)
    batches: list[KVEventBatch] = []
    tiers.subscribe(batches.append)
    keys = chain(tiers, 4, salt=1)
    write(tiers, keys)
    assert tiers.reset_cpu_tier() == 4
    assert cpu_misses(tiers, keys)
    assert cpu_occupancy(tiers)["cached_blocks"] == 0 and cpu_occupancy(tiers)["free_blocks"] == 4
    assert tiers.stats()["tiers"]["cpu"]["evictions"] == 4
    assert tiers.parts.events is not None and tiers.parts.events.flush()
    removed = [event for batch in batches for event in batch.events if isinstance(event, BlockRemoved)]
    assert [(event.medium, sorted(event.block_hashes)) for event in removed] == [("cpu", sorted(block_hashes(keys)))]

    fresh = chain(tiers, 4, salt=2)
    assert sorted(write(tiers, fresh)) == [0, 1, 2, 3], "every slot takes a new write, up to capacity"
    fetch = tiers.fetch(settled_lookup(tiers, fresh))
    assert fetched_bytes(tiers, fetch) == [block_bytes(tiers, key) for key in fresh]
    fetch.release()
    assert tiers.reset_cpu_tier() == 4 and tiers.reset_cpu_tier() == 0


def test_blocks_pinned_by_a_lookup_or_a_fetch_survive_the_reset_and_are_fetched_byte_equal(
    opened: list[LowerTiers],
) -> None:
    tiers = started(lower_config(cpu_blocks=4), opened)
    keys = chain(tiers, 4, salt=1)
    write(tiers, keys)
    looked_up = settled_lookup(tiers, keys[:2])
    fetch = tiers.fetch(settled_lookup(tiers, keys[:3]))
    assert tiers.reset_cpu_tier() == 1, "only the fourth block is held by nothing"
    assert write(tiers, chain(tiers, 4, salt=2)).count(None) == 3, "the held slots are not reused"
    assert fetched_bytes(tiers, fetch) == [block_bytes(tiers, key) for key in keys[:3]]
    later = tiers.fetch(looked_up)
    assert fetched_bytes(tiers, later) == [block_bytes(tiers, key) for key in keys[:2]]
    fetch.release()
    later.release()
    assert held_slots(tiers) == 0
    assert tiers.reset_cpu_tier() == 4


def test_a_block_the_engine_is_writing_survives_the_reset_and_commits(opened: list[LowerTiers]) -> None:
    tiers = started(lower_config(cpu_blocks=4), opened)
    done, writing = chain(tiers, 2, salt=1), chain(tiers, 2, salt=2)
    write(tiers, done)
    slots = tiers.begin_writes(writing)
    assert None not in slots
    tiers.buffer_view(slots[0])[:] = block_bytes(tiers, writing[0])  # type: ignore[index]
    assert tiers.reset_cpu_tier() == 2, "the written blocks go, those being written stay"
    tiers.buffer_view(slots[1])[:] = block_bytes(tiers, writing[1])  # type: ignore[index]
    tiers.end_writes(writing, slots, [True, True])  # type: ignore[arg-type]
    fetch = tiers.fetch(settled_lookup(tiers, writing))
    assert fetch.slots() == slots
    assert fetched_bytes(tiers, fetch) == [block_bytes(tiers, key) for key in writing]
    fetch.release()
    assert cpu_misses(tiers, done)


def test_a_block_whose_put_is_in_flight_stays_until_it_has_landed(opened: list[LowerTiers]) -> None:
    name = store_name()
    tiers = started(lower_config(cpu_blocks=4, remotes=[simulated(name)]), opened)
    keys = chain(tiers, 2, salt=1)
    remote(tiers).hold("put")
    try:
        write(tiers, keys)
        assert tiers.reset_cpu_tier() == 0, "the write-down to the remote still reads the slots"
    finally:
        remote(tiers).unhold("put")
    until(lambda: held_slots(tiers) == 0)
    assert stored(name)[keys[0]] and stored(name)[keys[1]]
    assert tiers.reset_cpu_tier() == 2


def test_after_a_reset_a_redis_remote_still_serves_the_blocks(
    opened: list[LowerTiers], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    tiers = started(lower_config(cpu_blocks=4, remotes=[
        {"type": "redis", "name": "redis", "options": {"url": redis_server.url}}]), opened)
    keys = chain(tiers, 4, salt=1)
    write(tiers, keys)
    until(lambda: redis_client.exists(*[b"tiercache:" + binascii.hexlify(key) for key in keys]) == 4)
    until(lambda: held_slots(tiers) == 0)  # every put has landed
    assert tiers.reset_cpu_tier() == 4
    assert cpu_misses(tiers, keys)
    hit = settled_lookup(tiers, keys)
    assert hit.tiers == ["redis"] * 4
    fetch = tiers.fetch(hit)
    assert fetched_bytes(tiers, fetch) == [block_bytes(tiers, key) for key in keys]
    fetch.release()
    assert redis_client.dbsize() == 4


def test_resets_racing_the_engines_calls_and_the_background_loop_never_hand_out_wrong_bytes(
    opened: list[LowerTiers],
) -> None:
    tiers = started(lower_config(cpu_blocks=6, remotes=[simulated(store_name())]), opened)
    stop = threading.Event()
    dropped: list[int] = []

    def reset_until_stopped() -> None:
        while not stop.is_set():
            dropped.append(tiers.reset_cpu_tier())

    resetter = threading.Thread(target=reset_until_stopped, daemon=True)
    resetter.start()
    try:
        for salt in range(60):
            keys = chain(tiers, 3, salt=salt % 5)
            write(tiers, keys)
            fetch = tiers.fetch(settled_lookup(tiers, keys))
            served = fetched_bytes(tiers, fetch)
            assert served == [block_bytes(tiers, key) for key in keys[: len(served)]]
            fetch.release()
    finally:
        stop.set()
        resetter.join()
    assert sum(dropped) > 0
    until(lambda: held_slots(tiers) == 0)
    cpu = tiers.parts.local.cpu
    assert cpu is not None
    with tiers.parts.books.lock:
        cpu.check_invariants()
