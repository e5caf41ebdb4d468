"""The remote-tier contract (``tiercache.tiers.base``) as checks that any tier runs.

Each check is a coroutine function of a ``StoreHarness`` (``harness.py``: how
to open the tier over a shared store, and raw access to that store). With
pytest, subclass ``RemoteTierContract`` and give it a ``harness`` fixture::

    from tiercache.testing.conformance import RemoteTierContract

    class TestS3Tier(RemoteTierContract):
        @pytest.fixture
        def harness(self, s3_bucket):
            return S3Harness(s3_bucket)

and every check becomes one test of ``TestS3Tier`` (each in its own event
loop, so no asyncio plug-in is needed). Without pytest:
``asyncio.run(check(harness))`` for each of ``CHECKS`` (a check that does not
apply to the tier raises ``NotTaken``).

What is checked: results are values (lists of the right length, never an
exception, also with the store unreachable); ``contains`` is three-valued and
says ``UNKNOWN`` when it cannot tell; a read reports True only with the exact
bytes written, and a damaged value never spoils its neighbours in a batch;
damaged values are removed (so the next store rewrites them), values of
another namespace or secret or format are left in place; the named counters
move as they should; ``last_error`` names the cause of a failure; ``close``
returns within a bound, background removals included; a tier that takes
carried checksums serves what they vouch for and treats a wrong one as damage;
the servers a tier checks apart (``check_reachability``) answer reachable over a
reachable store and unreachable over an unreachable one, leaving nothing behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tiercache.blocks.value_format import FORMAT_OFFSET, HEADER_SIZE, payload_checksum
from tiercache.testing.harness import (
    OTHER_FINGERPRINT,
    OTHER_SECRET,
    SECRET,
    Blocks,
    StoreHarness,
    bounded,
    buffers,
    namespace,
    opened,
)
from tiercache.tiers.base import COUNTED_BY_THE_TIER, LAST_ERROR, Presence, RemoteTier, ServerReachability
from tiercache.tiers.invalid_values import INVALID_DELETE_SKIPPED, INVALID_DELETED, INVALID_KEPT

UNKNOWN_FORMAT = 0x7F
"""A format version no release writes: a value of it is not this reader's to judge."""
Check = Callable[[StoreHarness], Awaitable[None]]


def _counter(tier: RemoteTier, name: str) -> float:
    value = tier.stats()[name]
    assert isinstance(value, (int, float)), f"stats()[{name!r}] is {value!r}, not a number"
    return float(value)


def _numbers(stats: Mapping[str, object]) -> dict[str, float]:
    return {name: float(value) for name, value in stats.items() if isinstance(value, (int, float))}


async def _write(harness: StoreHarness, blocks: Blocks, secret: bytes | None = None) -> list[bytes]:
    """Store ``blocks`` through a tier; the raw values the store then holds."""
    async with opened(harness, namespace(secret)) as writer:
        assert await bounded(harness, writer.put(blocks.keys, blocks.views())) == [True] * len(blocks.keys)
        await harness.settle(writer)
    values = [await harness.read_raw(key) for key in blocks.keys]
    assert all(value is not None for value in values), "a stored value is not in the store"
    return values  # type: ignore[return-value]


async def _read(harness: StoreHarness, tier: RemoteTier, blocks: Blocks, served: list[bool]) -> None:
    """Read ``blocks`` in one batch: exactly the ``served`` ones are True, with exactly their bytes."""
    out = buffers(len(blocks.keys), harness.block_bytes)
    assert await bounded(harness, tier.get_into(blocks.keys, out)) == served
    for index, ok in enumerate(served):
        if ok:
            assert bytes(out[index]) == blocks.payloads[index], f"block {index} was served with other bytes"


async def check_round_trip(harness: StoreHarness) -> None:
    """Written blocks are served byte-exact (twice, if asked twice), held; others absent; counters move."""
    blocks = Blocks.make(8, harness.block_bytes, seed=1)
    async with opened(harness, namespace()) as writer:
        assert await bounded(harness, writer.put([], [])) == []
        assert await bounded(harness, writer.get_into([], [])) == []
        assert await bounded(harness, writer.contains([])) == []
        await bounded(harness, writer.delete([]))
        written = _counter(writer, "bytes_written")
        assert await bounded(harness, writer.put(blocks.keys, blocks.views())) == [True] * 8
        assert _counter(writer, "bytes_written") - written >= 8 * harness.block_bytes
        await harness.settle(writer)
    unknown = Blocks.make(3, harness.block_bytes, seed=2).keys
    async with opened(harness, namespace()) as reader:
        before = _numbers(reader.stats())
        twice = Blocks(blocks.keys + blocks.keys[:1], blocks.payloads + blocks.payloads[:1])
        await _read(harness, reader, twice, [True] * 9)
        presence = await bounded(harness, reader.contains(blocks.keys + unknown))
        assert presence == [Presence.HELD] * 8 + [Presence.ABSENT] * 3
        assert await bounded(harness, reader.get_into(unknown, buffers(3, harness.block_bytes))) == [False] * 3
        after = _numbers(reader.stats())
        assert after["hits"] - before["hits"] == 9 and after["misses"] - before["misses"] == 3
        assert after["bytes_read"] - before["bytes_read"] == 9 * harness.block_bytes


async def check_delete(harness: StoreHarness) -> None:
    """A deleted key leaves the store; the others stay and are served."""
    blocks = Blocks.make(6, harness.block_bytes, seed=3)
    await _write(harness, blocks)
    async with opened(harness, namespace()) as tier:
        await bounded(harness, tier.delete(blocks.keys[:3]))
        await harness.settle(tier)
    assert [await harness.read_raw(key) is None for key in blocks.keys] == [True] * 3 + [False] * 3
    async with opened(harness, namespace()) as reader:
        kept = Blocks(blocks.keys[3:], blocks.payloads[3:])
        await _read(harness, reader, kept, [True] * 3)
        assert await bounded(harness, reader.contains(kept.keys)) == [Presence.HELD] * 3


async def check_damaged_values_are_misses_and_removed(harness: StoreHarness) -> None:
    """Truncated, bit-flipped, garbage and misplaced values are misses, removed; their neighbours are served."""
    blocks = Blocks.make(8, harness.block_bytes, seed=4)
    values = await _write(harness, blocks)
    flipped = bytearray(values[2])
    flipped[-1] ^= 0x01
    damaged = {
        1: values[1][: len(values[1]) // 2],
        2: bytes(flipped),
        3: b"\x00garbage" * (len(values[3]) // 8),
        4: values[0],  # another key's value
    }
    for index, value in damaged.items():
        await harness.write_raw(blocks.keys[index], value)
    async with opened(harness, namespace()) as reader:
        before = _numbers(reader.stats())
        await _read(harness, reader, blocks, [index not in damaged for index in range(8)])
        await harness.settle(reader)
        after = _numbers(reader.stats())
    assert after[INVALID_DELETED] - before[INVALID_DELETED] == len(damaged) * harness.copies
    assert after[INVALID_KEPT] == before[INVALID_KEPT]
    for index, key in enumerate(blocks.keys):
        if index in damaged:
            assert await harness.read_raw(key) is None, f"damaged value {index} was not removed"
    await _write(harness, Blocks([blocks.keys[i] for i in damaged], [blocks.payloads[i] for i in damaged]))
    async with opened(harness, namespace()) as reader:
        await _read(harness, reader, blocks, [True] * 8)


async def check_values_it_cannot_judge_are_kept(harness: StoreHarness) -> None:
    """Another namespace, another secret (or none), no MAC where one is required, an unknown format: kept."""
    blocks = Blocks.make(5, harness.block_bytes, seed=5)
    keys, payloads = blocks.keys, blocks.payloads
    future = bytearray(namespace().encode_value(keys[2], payloads[2]))
    future[FORMAT_OFFSET] = UNKNOWN_FORMAT
    planted = {
        0: namespace(fingerprint=OTHER_FINGERPRINT).encode_value(keys[0], payloads[0]),
        1: namespace(SECRET).encode_value(keys[1], payloads[1]),
        2: bytes(future),
        3: namespace().encode_value(keys[3], payloads[3]),
        4: namespace(OTHER_SECRET).encode_value(keys[4], payloads[4]),
    }
    for index, value in planted.items():
        await harness.write_raw(keys[index], value)
    readers = {None: [0, 1, 2], SECRET: [3, 4]}  # what an unkeyed and a keyed reader cannot judge
    for secret, indices in readers.items():
        async with opened(harness, namespace(secret)) as reader:
            before = _numbers(reader.stats())
            subset = Blocks([keys[i] for i in indices], [payloads[i] for i in indices])
            await _read(harness, reader, subset, [False] * len(indices))
            await harness.settle(reader)
            after = _numbers(reader.stats())
        assert after[INVALID_KEPT] - before[INVALID_KEPT] == len(indices) * harness.copies
        assert after[INVALID_DELETED] == before[INVALID_DELETED]
    for index, value in planted.items():
        assert await harness.read_raw(keys[index]) == value, f"value {index}, not the reader's to judge, was changed"


async def check_a_keyed_namespace_survives_readers_without_its_secret(harness: StoreHarness) -> None:
    """Readers with another secret or none delete nothing; the writer's reader serves all and removes damage."""
    blocks = Blocks.make(16, harness.block_bytes, seed=6)
    values = await _write(harness, blocks, SECRET)
    for secret in (OTHER_SECRET, None):
        async with opened(harness, namespace(secret)) as reader:
            await _read(harness, reader, blocks, [False] * 16)
            await harness.settle(reader)
            assert _counter(reader, INVALID_DELETED) == 0
    assert [await harness.read_raw(key) for key in blocks.keys] == values, "a reader without the secret changed values"
    async with opened(harness, namespace(SECRET)) as owner:
        await _read(harness, owner, blocks, [True] * 16)
    damaged = bytearray(values[5])
    damaged[HEADER_SIZE] ^= 0x01
    await harness.write_raw(blocks.keys[5], bytes(damaged))
    async with opened(harness, namespace(SECRET)) as owner:
        await _read(harness, owner, blocks, [index != 5 for index in range(16)])
        await harness.settle(owner)
        assert _counter(owner, INVALID_DELETED) == harness.copies
    assert await harness.read_raw(blocks.keys[5]) is None


async def check_an_unreachable_store_is_misses_unknowns_and_a_named_cause(harness: StoreHarness) -> None:
    """Nothing raises; reads miss, writes fail, presence is UNKNOWN (never ABSENT); ``last_error`` says why."""
    blocks = Blocks.make(4, harness.block_bytes, seed=7)
    async with opened(harness, namespace(), reachable=False) as tier:
        written = await bounded(harness, tier.put(blocks.keys, blocks.views()))
        assert written == [False] * 4 or (harness.queues_writes and all(isinstance(ok, bool) for ok in written))
        assert len(written) == 4
        assert await bounded(harness, tier.get_into(blocks.keys, buffers(4, harness.block_bytes))) == [False] * 4
        assert await bounded(harness, tier.contains(blocks.keys)) == [Presence.UNKNOWN] * 4
        await bounded(harness, tier.delete(blocks.keys))
        cause = tier.stats().get(LAST_ERROR)
        assert isinstance(cause, str) and cause.strip(), f"no cause in last_error: {cause!r}"
        assert tier.last_error == cause


async def check_named_counters(harness: StoreHarness) -> None:
    """``stats()`` holds the contract's names as numbers (and ``last_error`` only as text)."""
    missing = Blocks.make(1, harness.block_bytes, seed=8).keys
    async with opened(harness, namespace()) as tier:
        await bounded(harness, tier.get_into(missing, buffers(1, harness.block_bytes)))
        stats = tier.stats()
    for name in (*COUNTED_BY_THE_TIER, INVALID_DELETED, INVALID_KEPT, INVALID_DELETE_SKIPPED):
        assert isinstance(stats.get(name), (int, float)), f"stats() lacks the number {name!r}"
    assert all(isinstance(value, (int, float)) for name, value in stats.items() if name != LAST_ERROR)


async def check_close_is_bounded_with_removals_in_flight(harness: StoreHarness) -> None:
    """``close`` right after reads that found damage returns within the bound, its background work done."""
    blocks = Blocks.make(8, harness.block_bytes, seed=9)
    await _write(harness, blocks)
    for key in blocks.keys:
        await harness.write_raw(key, b"\x00garbage" * 16)
    tier = await bounded(harness, harness.open(namespace()))
    await bounded(harness, tier.get_into(blocks.keys, buffers(8, harness.block_bytes)))
    await asyncio.wait_for(tier.close(), harness.close_bound_s)
    assert all(task.done() for task in tier.invalid_values.tasks())


async def check_carried_checksums(harness: StoreHarness) -> None:
    """A tier that ``takes_checksums`` stores with the ones it is given: right ones are served byte-exact,
    a wrong one is a miss (never other bytes), removed as damaged, and spoils no neighbour."""
    blocks = Blocks.make(6, harness.block_bytes, seed=10)
    async with opened(harness, namespace()) as writer:
        if not writer.capabilities.takes_checksums:
            raise NotTaken(f"{type(writer).__name__} does not take checksums")
        checksums: list[int | None] = [payload_checksum(payload) for payload in blocks.payloads]
        checksums[2] = None
        checksums[4] = (checksums[3] or 0) ^ 1  # another block's checksum, off by a bit
        stored = await bounded(harness, writer.put(blocks.keys, blocks.views(), checksums=checksums))
        assert stored == [True] * 6
        await harness.settle(writer)
    async with opened(harness, namespace()) as reader:
        before = _numbers(reader.stats())
        await _read(harness, reader, blocks, [index != 4 for index in range(6)])
        await harness.settle(reader)
        after = _numbers(reader.stats())
    assert after[INVALID_DELETED] - before[INVALID_DELETED] == harness.copies
    assert await harness.read_raw(blocks.keys[4]) is None, "the value stored with a wrong checksum was not removed"


async def check_servers_checked_apart(harness: StoreHarness) -> None:
    """``check_reachability`` answers ``ServerReachability``s: all reachable over a reachable store (the check's
    block deleted after), none over an unreachable one; never raises."""
    key = Blocks.make(1, harness.block_bytes, seed=11).keys[0]
    async with opened(harness, namespace()) as tier:
        servers = await bounded(harness, tier.check_reachability(key))
        await harness.settle(tier)
    assert all(isinstance(server, ServerReachability) and server.ok for server in servers), servers
    assert await harness.read_raw(key) is None, "the check left its block in the store"
    async with opened(harness, namespace(), reachable=False) as tier:
        servers = await bounded(harness, tier.check_reachability(key))
    assert not any(server.ok for server in servers), servers


class NotTaken(Exception):
    """A check that does not apply to the tier (it lacks the capability the check is about)."""


CHECKS: list[Check] = [
    check_round_trip,
    check_delete,
    check_damaged_values_are_misses_and_removed,
    check_values_it_cannot_judge_are_kept,
    check_a_keyed_namespace_survives_readers_without_its_secret,
    check_an_unreachable_store_is_misses_unknowns_and_a_named_cause,
    check_named_counters,
    check_close_is_bounded_with_removals_in_flight,
    check_carried_checksums,
    check_servers_checked_apart,
]
"""Every check, in the order ``RemoteTierContract`` runs them."""


class RemoteTierContract:
    """The checks as pytest tests: subclass as ``Test<YourTier>`` and define a ``harness`` fixture.

    One ``test_<name>`` per ``check_<name>`` in ``CHECKS``, made below, so a check added there runs everywhere.
    """


def _as_test(check: Check) -> Callable[[Any, StoreHarness], None]:
    def test(self: Any, harness: StoreHarness) -> None:
        try:
            asyncio.run(check(harness))
        except NotTaken as reason:
            import pytest  # only where the checks run under pytest

            pytest.skip(str(reason))

    test.__name__ = test.__qualname__ = "test_" + check.__name__.removeprefix("check_")
    test.__doc__ = check.__doc__
    return test


for _check in CHECKS:
    _test = _as_test(_check)
    setattr(RemoteTierContract, _test.__name__, _test)
