"""LowerTiers step by step: the CPU tier and remotes under an engine that keeps its own GPU pool.

Real parts only: the CPU tier, the simulated remote (with its ``hold``/``corrupt``/
``set_down`` controls) and a real Redis. The test plays the engine: it copies bytes
into the slots ``begin_writes`` gives and out of those a fetch pins.
"""

from __future__ import annotations

import binascii
import threading

import pytest
import redis
import torch
from support.lower_tiers_helpers import (
    LAYOUT,
    WAIT_S,
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

from tiercache.config import ConfigError, config_from_dict
from tiercache.manager.lower_tiers import LowerTiers
from tiercache.movement.runtime import CLOSE_DRAIN_SECONDS
from tiercache.testing.redis_servers import RedisServer


def test_a_cpu_hit_pinned_by_lookup_is_never_evicted_by_write_pressure(opened: list[LowerTiers]) -> None:
    tiers = started(lower_config(cpu_blocks=4), opened)
    first = chain(tiers, 4, salt=1)
    write(tiers, first)
    hit = tiers.lookup(first[:2])
    assert hit is not None and hit.tiers == ["cpu", "cpu"]
    pressure = chain(tiers, 4, salt=2)
    slots = write(tiers, pressure)
    assert sum(slot is not None for slot in slots) == 2, "only the two unpinned slots could be reused"
    fetch = tiers.fetch(hit)
    assert fetch.ready()
    assert [slot_bytes(tiers, slot) for slot in fetch.slots()] == [block_bytes(tiers, key) for key in first[:2]]
    fetch.release()
    assert held_slots(tiers) == 0
    assert cpu_occupancy(tiers)["cached_blocks"] == 4


def test_released_pins_let_pressure_evict_again(opened: list[LowerTiers]) -> None:
    tiers = started(lower_config(cpu_blocks=4), opened)
    first = chain(tiers, 4, salt=1)
    write(tiers, first)
    hit = tiers.lookup(first)
    assert hit is not None and hit.num_blocks == 4
    assert write(tiers, chain(tiers, 2, salt=2)) == [None, None], "every slot is pinned: no room, nothing evicted"
    assert cpu_occupancy(tiers)["cached_blocks"] == 4
    tiers.release(hit)
    assert held_slots(tiers) == 0
    assert None not in write(tiers, chain(tiers, 2, salt=3))


def test_fetch_of_cpu_resident_blocks_is_ready_at_once_with_their_slots(opened: list[LowerTiers]) -> None:
    tiers = started(lower_config(cpu_blocks=8), opened)
    keys = chain(tiers, 3, salt=1)
    slots = write(tiers, keys)
    hit = tiers.lookup(keys)
    assert hit is not None and hit.tiers == ["cpu"] * 3
    fetch = tiers.fetch(hit)
    assert fetch.ready()
    assert fetch.slots() == slots
    assert [slot_bytes(tiers, slot) for slot in fetch.slots()] == [block_bytes(tiers, key) for key in keys]
    assert held_slots(tiers) == 3
    fetch.release()
    assert held_slots(tiers) == 0


def test_fetch_from_a_remote_arrives_in_the_background_with_the_bytes_another_instance_wrote(
    opened: list[LowerTiers],
) -> None:
    name = store_name()
    writer = started(lower_config(remotes=[simulated(name)]), opened)
    keys = chain(writer, 3, salt=1)
    write(writer, keys)
    until(lambda: all(key in stored(name) for key in keys))
    reader = started(lower_config(remotes=[simulated(name)]), opened)
    hit = settled_lookup(reader, keys)
    assert hit.tiers == ["sim"] * 3
    remote(reader).hold("get")
    fetch = reader.fetch(hit)
    try:
        assert not fetch.ready()
        assert fetch.slots() == [], "nothing was in the CPU tier: no slot may be copied before the read ends"
    finally:
        remote(reader).unhold("get")
    until(fetch.ready)
    assert [slot_bytes(reader, slot) for slot in fetch.slots()] == [block_bytes(writer, key) for key in keys]
    fetch.release()
    assert held_slots(reader) == 0
    warm = reader.lookup(keys, local_only=True)
    assert warm is not None and warm.tiers == ["cpu"] * 3, "the blocks read stay in the CPU tier"
    reader.release(warm)


def test_lookup_is_none_while_a_remote_presence_check_is_in_flight_then_answers(opened: list[LowerTiers]) -> None:
    name = store_name()
    writer = started(lower_config(remotes=[simulated(name)]), opened)
    keys = chain(writer, 2, salt=1)
    write(writer, keys)
    until(lambda: all(key in stored(name) for key in keys))
    reader = started(lower_config(remotes=[simulated(name)]), opened)
    remote(reader).hold("contains")
    try:
        assert reader.lookup(keys) is None
        assert reader.lookup(keys) is None, "asking again does not answer before the remote does"
        assert held_slots(reader) == 0
    finally:
        remote(reader).unhold("contains")
    hit = settled_lookup(reader, keys)
    assert hit.tiers == ["sim", "sim"]
    reader.release(hit)


@pytest.mark.parametrize("fault", ["corrupt", "down", "deleted"])
def test_a_failing_remote_gives_a_shorter_prefix_never_wrong_bytes(opened: list[LowerTiers], fault: str) -> None:
    name = store_name()
    writer = started(lower_config(remotes=[simulated(name)]), opened)
    keys = chain(writer, 4, salt=1)
    write(writer, keys)
    until(lambda: all(key in stored(name) for key in keys))
    reader = started(lower_config(remotes=[simulated(name)]), opened)
    hit = settled_lookup(reader, keys)
    assert hit.num_blocks == 4
    tier = remote(reader)
    if fault == "corrupt":
        tier.corrupt(keys[2])
    elif fault == "deleted":
        del stored(name)[keys[1]]
    else:
        tier.set_down(True)
    fetch = reader.fetch(hit)
    until(fetch.ready)
    expected = {"corrupt": 2, "deleted": 1, "down": 0}[fault]
    assert len(fetch.slots()) == expected
    assert [slot_bytes(reader, slot) for slot in fetch.slots()] == [block_bytes(writer, k) for k in keys[:expected]]
    fetch.release()
    assert held_slots(reader) == 0


def test_begin_writes_refuses_held_keys_and_keys_in_flight(opened: list[LowerTiers]) -> None:
    tiers = started(lower_config(cpu_blocks=8), opened)
    keys = chain(tiers, 4, salt=1)
    write(tiers, keys[:2])
    slots = tiers.begin_writes(keys)
    assert slots[:2] == [None, None], "held already"
    assert None not in slots[2:]
    assert tiers.begin_writes(keys[2:]) == [None, None], "being written"
    tiers.end_writes(keys[2:], [s for s in slots[2:] if s is not None], [True, True])
    assert held_slots(tiers) == 0
    assert cpu_occupancy(tiers)["cached_blocks"] == 4


def test_capacity_holds_when_every_slot_is_pinned_or_being_written(opened: list[LowerTiers]) -> None:
    tiers = started(lower_config(cpu_blocks=3), opened)
    keys = chain(tiers, 2, salt=1)
    write(tiers, keys)
    hit = tiers.lookup(keys)
    in_flight = tiers.begin_writes(chain(tiers, 2, salt=2))
    assert in_flight.count(None) == 1, "one free slot, two pinned"
    assert tiers.begin_writes(chain(tiers, 3, salt=3)) == [None] * 3
    occupancy = cpu_occupancy(tiers)
    assert occupancy["capacity_blocks"] == 3 and occupancy["free_blocks"] == 0
    tiers.release(hit)
    tiers.end_writes([], [], [])


def test_write_through_reaches_the_remote_after_end_writes_and_a_failed_write_leaves_nothing(
    opened: list[LowerTiers],
) -> None:
    name = store_name()
    tiers = started(lower_config(remotes=[simulated(name)]), opened)
    good, bad = chain(tiers, 2, salt=1), chain(tiers, 2, salt=2)
    slots = tiers.begin_writes(good)
    for key, slot in zip(good, slots, strict=True):
        assert slot is not None
        tiers.buffer_view(slot)[:] = block_bytes(tiers, key)
    assert not any(key in stored(name) for key in good), "nothing goes down before the engine's copy ended"
    write(tiers, bad, ok=False)
    tiers.end_writes(good, [s for s in slots if s is not None], [True, True])
    until(lambda: all(key in stored(name) for key in good))
    assert not any(key in stored(name) for key in bad)
    miss = tiers.lookup(bad, local_only=True)
    assert miss is not None and miss.num_blocks == 0
    tiers.release(miss)
    # the puts' pins go when their completions reach the loop, just after the keys show in the store
    until(lambda: held_slots(tiers) == 0)
    assert write(tiers, bad) != [None, None], "a failed write does not hold the keys: they may be written again"


def test_every_pin_goes_back_through_release_and_fetch_release(opened: list[LowerTiers]) -> None:
    name = store_name()
    writer = started(lower_config(remotes=[simulated(name)]), opened)
    keys = chain(writer, 4, salt=1)
    write(writer, keys)
    until(lambda: all(key in stored(name) for key in keys))
    reader = started(lower_config(cpu_blocks=6, remotes=[simulated(name)]), opened)
    write(reader, keys[:2])
    dropped = settled_lookup(reader, keys)
    assert dropped.tiers == ["cpu", "cpu", "sim", "sim"]
    reader.release(dropped)
    assert held_slots(reader) == 0
    partial = settled_lookup(reader, keys)
    fetch = reader.fetch(partial, 3)
    assert len(fetch.items) == 3
    until(fetch.ready)
    assert held_slots(reader) == 3, "the fourth block's pin went with the fetch's plan"
    fetch.release()
    assert held_slots(reader) == 0
    remote(reader).hold("get")
    early = reader.fetch(settled_lookup(reader, keys))  # three blocks in the CPU tier now, the fourth remote
    assert not early.ready() and len(early.slots()) == 3, "the CPU-resident head may be copied at once"
    early.release()  # before its read ended: the pins go once it has
    remote(reader).unhold("get")
    until(early.ready)
    until(lambda: held_slots(reader) == 0)


def test_a_remote_hit_without_staging_room_is_cut_where_the_room_ends(opened: list[LowerTiers]) -> None:
    name = store_name()
    writer = started(lower_config(remotes=[simulated(name)]), opened)
    keys = chain(writer, 3, salt=1)
    write(writer, keys)
    until(lambda: all(key in stored(name) for key in keys))
    reader = started(lower_config(cpu_blocks=3, remotes=[simulated(name)]), opened)
    other = chain(reader, 2, salt=2)
    write(reader, other)
    pinning = reader.lookup(other)
    assert pinning is not None and pinning.num_blocks == 2
    fetch = reader.fetch(settled_lookup(reader, keys))
    until(fetch.ready)
    assert [slot_bytes(reader, slot) for slot in fetch.slots()] == [block_bytes(writer, keys[0])]
    assert cpu_occupancy(reader)["cached_blocks"] <= 3
    fetch.release()
    reader.release(pinning)
    assert held_slots(reader) == 0


@pytest.mark.parametrize(
    ("tiers", "field"),
    [
        ([{"type": "gpu", "capacity_blocks": 4, "options": {"device": "cpu"}}, {"type": "cpu", "capacity_blocks": 4}],
         "tiers[0].type"),
        ([{"type": "simulated"}, {"type": "cpu", "capacity_blocks": 4}], "tiers[0].type"),
        ([{"type": "cpu", "capacity_blocks": 4}, {"type": "gpu", "capacity_blocks": 4}], "tiers[1].type"),
        ([{"type": "cpu", "capacity_blocks": 4}, {"type": "simulated"}, {"type": "cpu", "capacity_blocks": 4,
          "name": "cpu2"}], "tiers[2].type"),
        ([{"type": "cpu", "capacity_blocks": 4, "write_policy": "write_back"}], "tiers[0].write_policy"),
    ],
    ids=["gpu-first", "remote-first", "gpu-below", "second-cpu", "write-back-cpu"],
)
def test_the_config_refuses_what_lower_tiers_cannot_run_naming_the_field(tiers: list, field: str) -> None:
    data = {"model": {"id": "m"}, "layout": LAYOUT, "tiers": tiers}
    with pytest.raises(ConfigError) as refused:
        config_from_dict(data, "topology.yaml", environ={}, engine_pool=True)
    assert field in str(refused.value) and "topology.yaml" in str(refused.value)


def test_lower_tiers_refuses_a_topology_with_a_gpu_pool() -> None:
    data = {"model": {"id": "m"}, "layout": LAYOUT,
            "tiers": [{"type": "gpu", "capacity_blocks": 4, "options": {"device": "cpu"}},
                      {"type": "cpu", "capacity_blocks": 4}]}
    with pytest.raises(ValueError, match="first tier is the CPU tier"):
        LowerTiers(config_from_dict(data, environ={}))


@pytest.mark.parametrize(
    "buffer",
    [torch.zeros(3, 128, dtype=torch.uint8), torch.zeros(4, 64, dtype=torch.uint8),
     torch.zeros(4, 32, dtype=torch.float32)],
    ids=["too-few-slots", "short-slots", "not-bytes"],
)
def test_a_cpu_buffer_of_the_wrong_shape_is_refused(buffer: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"\[4, 128\]|\(4, 128\)"):
        LowerTiers(lower_config(cpu_blocks=4), cpu_buffer=buffer)


def test_the_callers_cpu_buffer_holds_the_slots(opened: list[LowerTiers]) -> None:
    buffer = torch.zeros(4, 128, dtype=torch.uint8)
    tiers = started(lower_config(cpu_blocks=4), opened, cpu_buffer=buffer)
    keys = chain(tiers, 2, salt=1)
    for key, slot in zip(keys, write(tiers, keys), strict=True):
        assert slot is not None and bytes(buffer[slot].numpy()) == block_bytes(tiers, key)


def test_close_is_bounded_with_a_sigstopped_redis(opened: list[LowerTiers], redis_server: RedisServer) -> None:
    redis = {"type": "redis", "name": "redis", "options": {"url": redis_server.url}}
    tiers = LowerTiers(lower_config(cpu_blocks=8, remotes=[redis]))
    tiers.start()
    keys = chain(tiers, 4, salt=1)
    write(tiers, keys[:2])
    redis_server.stop()
    try:
        write(tiers, keys[2:])  # write-through puts to a server that answers nothing
        assert tiers.lookup(chain(tiers, 2, salt=2)) is None, "a presence check of the stopped server is in flight"
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (tiers.close(), closed.set()), daemon=True)
        closer.start()
        assert closed.wait(CLOSE_DRAIN_SECONDS + WAIT_S), "close hung on a stopped Redis"
        after = tiers.lookup(keys[:2])
        assert after is not None and after.num_blocks == 2, "after close, lookups answer from the CPU tier"
    finally:
        redis_server.cont()


def test_a_real_redis_serves_exact_bytes_and_a_damaged_value_cuts_the_prefix_and_goes(
    opened: list[LowerTiers], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    remote = {"type": "redis", "name": "redis", "options": {"url": redis_server.url}}
    writer = started(lower_config(remotes=[remote]), opened)
    keys = chain(writer, 4, salt=1)
    write(writer, keys)
    names = [b"tiercache:" + binascii.hexlify(key) for key in keys]
    until(lambda: redis_client.exists(*names) == 4)
    damaged = bytearray(redis_client.get(names[2]))
    damaged[-1] ^= 0xFF
    redis_client.set(names[2], bytes(damaged))
    reader = started(lower_config(remotes=[remote]), opened)
    fetch = reader.fetch(settled_lookup(reader, keys))
    until(fetch.ready)
    assert [slot_bytes(reader, slot) for slot in fetch.slots()] == [block_bytes(writer, key) for key in keys[:2]]
    fetch.release()
    until(lambda: not redis_client.exists(names[2]))  # proven damaged (its checksum): removed, to be rewritten
    assert redis_client.exists(names[3]) == 1
    assert held_slots(reader) == 0
