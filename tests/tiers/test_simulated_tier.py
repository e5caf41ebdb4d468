"""The simulated remote tier: round trips, injected faults, and fairness among clients of one store."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from tiercache.blocks.codec import Codec
from tiercache.config import ConfigError
from tiercache.tiers import tier_class
from tiercache.tiers.base import Presence, RemoteContext
from tiercache.tiers.simulated import SimulatedOptions, SimulatedStore, SimulatedTier

HELD, ABSENT = Presence.HELD, Presence.ABSENT

BLOCK_BYTES = 256
FINGERPRINT = bytes(range(16))


def make_tier(store: SimulatedStore | None = None, **options: object) -> SimulatedTier:
    context = RemoteContext("sim", Codec(FINGERPRINT), BLOCK_BYTES)
    return SimulatedTier(context, SimulatedOptions(**options), store=store)


def keys_and_payloads(count: int, salt: int = 0) -> tuple[list[bytes], list[memoryview]]:
    keys = [(salt * 100_000 + i).to_bytes(16, "little") for i in range(count)]
    payloads = [memoryview(bytes([(i + salt) % 256]) * BLOCK_BYTES) for i in range(count)]
    return keys, payloads


def buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(BLOCK_BYTES)) for _ in range(count)]


async def test_round_trip_keeps_bytes_and_header() -> None:
    tier = make_tier(latency_ms=0)
    await tier.start()
    keys, payloads = keys_and_payloads(5)
    assert await tier.put(keys, payloads) == [True] * 5
    assert await tier.contains([*keys, b"\xff" * 16]) == [HELD] * 5 + [ABSENT]
    dests = buffers(5)
    assert await tier.get_into(keys, dests) == [True] * 5
    assert [bytes(d) for d in dests] == [bytes(p) for p in payloads]
    assert tier.stats()["get_calls"] == 1


async def test_corrupted_and_garbage_values_are_misses() -> None:
    tier = make_tier(latency_ms=0)
    keys, payloads = keys_and_payloads(4)
    await tier.put(keys, payloads)
    tier.corrupt(keys[1])
    results = await tier.get_into(keys, buffers(4))
    assert results == [True, False, True, True]
    assert tier.stats()["corrupt"] == 1

    tier.store.data[keys[1]] = tier.codec.encode_value(keys[1], payloads[1])
    noisy = make_tier(store=tier.store, latency_ms=0, garbage_rate=1.0)
    assert await noisy.get_into(keys, buffers(4)) == [False] * 4
    assert noisy.stats()["corrupt"] == 4


async def test_error_rate_is_seeded_and_partial() -> None:
    outcomes = []
    for _ in range(2):
        tier = make_tier(latency_ms=0, error_rate=0.5, seed=7)
        keys, payloads = keys_and_payloads(64)
        outcomes.append(await tier.put(keys, payloads))
    assert outcomes[0] == outcomes[1]
    assert 0 < sum(outcomes[0]) < 64


async def test_timeouts_and_down_windows_fail_whole_requests() -> None:
    tier = make_tier(latency_ms=0, timeout_rate=1.0, timeout_ms=1)
    keys, payloads = keys_and_payloads(3)
    assert await tier.put(keys, payloads) == [False] * 3
    assert tier.stats()["timeouts"] == 1

    down = make_tier(latency_ms=0, down_windows_s=[[0.0, 3600.0]])
    await down.start()
    assert await down.put(keys, payloads) == [False] * 3
    assert down.stats()["down_rejections"] == 1
    down.set_down(False)  # the down window still holds: a tier that cannot answer says so
    assert await down.contains(keys) == [Presence.UNKNOWN] * 3
    assert down.stats()["down_rejections"] == 2


def test_options_are_validated_from_yaml() -> None:
    from tiercache.config import build_dataclass

    options = build_dataclass(tier_class("simulated").Options, {"latency_ms": 2, "seed": 3}, "t.yaml", "opts")
    assert options.latency_ms == 2.0
    with pytest.raises(ConfigError, match="error_rate"):
        build_dataclass(SimulatedOptions, {"error_rate": 2}, "t.yaml", "opts")


async def test_hold_orders_requests_without_sleeping() -> None:
    tier = make_tier(latency_ms=0)
    await tier.start()
    keys, payloads = keys_and_payloads(2)
    tier.hold("put", allow=1)
    first = asyncio.ensure_future(tier.put(keys[:1], payloads[:1]))
    second = asyncio.ensure_future(tier.put(keys[1:], payloads[1:]))
    assert await first == [True]
    await asyncio.sleep(0)
    assert not second.done()
    tier.unhold("put")
    assert await second == [True]


async def _run_clients(fair: bool) -> tuple[list[int], list[float], int]:
    """One client streams a huge batch while small clients each read one block, repeatedly.

    Returns, per small request, how many sub-batches of the big client crossed
    the link between its submission and its completion; plus latencies (for
    display) and the big client's sub-batch count.
    """
    small_clients = 8
    rounds = 4
    huge_blocks = 512
    store = SimulatedStore(SimulatedOptions(bandwidth_mb_s=50.0, max_batch_blocks=16, fair=fair))
    keys, payloads = keys_and_payloads(huge_blocks)
    big = make_tier(store=store, latency_ms=0)
    smalls = [make_tier(store=store, latency_ms=0) for _ in range(small_clients)]
    for key, payload in zip(keys, payloads, strict=True):
        store.save(key, big.codec.encode_value(key, payload))
    link = store.link()

    behind: list[int] = []
    latencies: list[float] = []

    async def small_reader(tier: SimulatedTier, index: int) -> None:
        loop = asyncio.get_running_loop()
        for r in range(rounds):
            mark = len(link.served)
            started = loop.time()
            assert await tier.get_into([keys[(index + r) % huge_blocks]], buffers(1)) == [True]
            latencies.append(loop.time() - started)
            behind.append(sum(1 for client in link.served[mark:] if client == big.client))

    big_read = asyncio.ensure_future(big.get_into(keys, buffers(huge_blocks)))
    await asyncio.sleep(0)
    await asyncio.gather(*(small_reader(tier, i) for i, tier in enumerate(smalls)))
    assert all(await big_read)
    store.close()
    return behind, latencies, link.served.count(big.client)


async def test_no_client_starves_behind_a_huge_batch() -> None:
    fair_behind, fair_latency, big_batches = await _run_clients(fair=True)
    fifo_behind, fifo_latency, _ = await _run_clients(fair=False)
    # Round-robin: a small read waits for the big sub-batch on the link and at most one more turn.
    assert max(fair_behind) <= 2
    # First come first served: the first small reads wait for (nearly) the whole huge batch.
    assert max(fifo_behind) >= big_batches - 1
    spread = {
        "fair": (statistics.median(fair_latency), max(fair_latency)),
        "fifo": (statistics.median(fifo_latency), max(fifo_latency)),
    }
    print("small-request latency (median, max) seconds:", spread)
