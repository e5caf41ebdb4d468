"""``CodedTier``: a remote tier that stores and reads KV at the levels of its ``codec`` (exact, int8, compact).

A topology's remote tier with a lossy ``codec`` is its own tier (Redis, files,
regional, a plug-in) wrapped in this one; the stack and the lanes see one tier.

- **Levels are copies.** A write stores the block at every level the codec lists,
  each its own value under its own key (``KVCoding.key``: the block key for
  exact, a keyed hash of it, the level and the tables for the others), encoded
  here, in a worker thread, off the engine's path and the event loop. The value's
  header names its coding and level (``tiercache.blocks.codec``).
- **Reads decode straight into the slot.** The inner tier's codec reads exactly
  the codec's lossy levels and decodes a coded value into the caller's buffer in
  the inner tier's own read path; a reader whose codec lists no lossy level has
  no coding at all, so lossy values are invisible to it.
- **Which level.** Without ``adaptive`` a read asks for the levels in the order
  listed, each for the blocks the ones before did not fill. With it, each chunk of
  ``chunk_blocks`` blocks is read at the level ``LevelChooser`` picks from the
  throughput and latency the tier's recent reads met and each level's decode time,
  then at the other levels for what that level did not hold; where even the
  cheapest level would arrive later than prefill computes the chunk
  (``recompute_seconds``, the cost model's), the chunk and the rest of the read
  are answered as misses. A level never mixes within a chunk. On a link no read
  has timed yet, a small probe chunk goes first, alone (the presence checks' round
  trip, timed here, is its latency).
- **Presence** is held where any level the tier reads is held (the first level
  listed asked first, the others only where it is not held).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from tiercache.blocks.value_format import CodedPayload
from tiercache.codecs.choice import LevelChooser
from tiercache.codecs.coding import KVCoding
from tiercache.codecs.levels import CodecConfig, Level
from tiercache.tiers.base import (
    BreakerSettings,
    EvictionListener,
    Presence,
    RemoteContext,
    RemoteTier,
    ServerReachability,
)

CHUNKS_IN_FLIGHT = 2
"""Chunks of an adaptive read asked for at once: later chunks' requests overlap earlier ones' transfers (a
round trip is not paid per chunk), and each chunk's level is chosen when its turn comes, from what the chunks
before it met."""

PROBE_BLOCKS = 2
"""A tier whose link no read has timed yet reads this many blocks alone first, at the prior's level, so the
fetch's other chunks are chosen from a measured link rather than from the prior (its throughput net of the
presence check's round trip: two blocks are enough, and every block more is paid at a level chosen blind). The
probe is never answered as a recompute: one round trip, paid once per fetch, is no measure of a chunk's cost."""

RecomputeSeconds = Callable[[int], float | None]
"""The engine's expected prefill time for a number of tokens (None while unknown)."""


class CodedTier(RemoteTier):
    """``inner`` at the levels of ``config`` (see the module docstring)."""

    def __init__(self, inner: RemoteTier, coding: KVCoding, config: CodecConfig) -> None:
        super().__init__(RemoteContext(inner.name, inner.codec, inner.block_bytes), inner.options)
        self.inner = inner
        self.coding = coding
        self.config = config
        self.capabilities = dataclasses.replace(
            inner.capabilities, takes_checksums=False,
            reports_evictions=inner.capabilities.reports_evictions and config.levels == [Level.EXACT],
        )
        wire = {level: coding.wire_bytes(level) for level in config.levels}
        self.chooser = LevelChooser(config.levels, wire, coding.geometry.block_bytes)
        self.recompute_seconds: RecomputeSeconds | None = None
        """Set by the owner of the cost model (``LinkObserver.recompute_seconds``: under its lock); None: never
        recompute."""

    # -- the inner tier's lifecycle ------------------------------------------

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()
        await super().close()

    async def settle(self) -> None:
        await self.inner.settle()

    def breaker_settings(self) -> BreakerSettings | None:
        return self.inner.breaker_settings()

    async def check_reachability(self, key: bytes) -> list[ServerReachability]:
        return await self.inner.check_reachability(key)

    def on_evicted(self, listener: EvictionListener) -> None:
        self.inner.on_evicted(listener)

    @property
    def last_error(self) -> str | None:
        return self.inner.last_error

    # -- data path ------------------------------------------------------------

    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        """Held where any level is: the first level listed is asked for every key, the others only for the keys
        it does not hold, in one call (a fleet stores all its levels, so one call of ``len(keys)`` questions is
        the rule: a tier counts its requests in flight, and asking every level would multiply its round trips)."""
        first, *others = self.config.levels
        started = time.perf_counter()
        found = await self.inner.contains(self._keys(keys, first))
        self.chooser.round_trip(time.perf_counter() - started)
        missing = [i for i, answer in enumerate(found) if answer is not Presence.HELD]
        if others and missing:
            asked = [keys[i] for i in missing]
            more = await self.inner.contains([key for level in others for key in self._keys(asked, level)])
            for j, i in enumerate(missing):
                found[i] = _any_held([found[i], *more[j :: len(missing)]])
        return found

    async def put(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        stored_keys: list[bytes] = []
        stored: list[Any] = []
        lossy = [level for level in self.config.levels if level.lossy]
        if lossy:
            coded = await asyncio.to_thread(self._encode, lossy, payloads)
            for level, values in zip(lossy, coded, strict=True):
                stored_keys += self._keys(keys, level)
                stored += values
        if Level.EXACT in self.config.levels:
            stored_keys += keys
            stored += payloads
        results = await self.inner.put(stored_keys, stored)
        count = len(keys)
        return [all(results[i::count]) for i in range(count)]

    def _encode(self, levels: Sequence[Level], payloads: Sequence[memoryview]) -> list[list[CodedPayload]]:
        """Every payload at every lossy level (in a worker thread)."""
        return [[self.coding.encode(level, payload) for payload in payloads] for level in levels]

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        results = [False] * len(keys)
        if not self.config.adaptive:
            await self._read_levels(self.config.levels, list(range(len(keys))), keys, dests, results, force_latest)
            return results
        chunk = self.config.chunk_blocks
        slots = asyncio.Semaphore(CHUNKS_IN_FLIGHT)
        stop = asyncio.Event()
        started = time.perf_counter()
        delivered = [0.0]

        async def read_chunk(start: int, end: int, probe: bool = False) -> None:
            async with slots:
                if stop.is_set():
                    return
                positions = list(range(start, end))
                tokens = len(positions) * self.coding.geometry.tokens
                recompute = (self.recompute_seconds(tokens) if self.recompute_seconds is not None and not probe
                             else None)
                level = self.chooser.choose(len(positions), recompute)
                if level is None:
                    self.chooser.recomputed(len(positions))
                    stop.set()  # keys chain: nothing after a recomputed chunk is of use
                    return
                order = [level] + [other for other in self.chooser.ranked(len(positions)) if other is not level]
                moved = await self._read_levels(order, positions, keys, dests, results, force_latest)
                delivered[0] += moved
                self.chooser.delivered(delivered[0], time.perf_counter() - started)

        first = 0
        if not self.chooser.measured and len(keys) > PROBE_BLOCKS:  # a link never timed: a small chunk alone first
            await read_chunk(0, PROBE_BLOCKS, probe=True)
            first = PROBE_BLOCKS
        await asyncio.gather(*(read_chunk(start, min(start + chunk, len(keys)))
                               for start in range(first, len(keys), chunk)))
        if stop.is_set():  # a chunk after a recomputed one may have been read before the decision: not served
            gap = next((i for i, ok in enumerate(results) if not ok), len(results))
            results[gap:] = [False] * (len(results) - gap)
        return results

    async def _read_levels(
        self, levels: Sequence[Level], positions: list[int], keys: Sequence[bytes], dests: Sequence[memoryview],
        results: list[bool], force_latest: bool,
    ) -> float:
        """Read ``positions`` at each level in turn, each for what the levels before did not fill; the bytes the
        link moved (each level's mean value size for what it filled)."""
        pending = positions
        moved = 0.0
        for level in levels:
            if not pending:
                break
            started = time.perf_counter()
            oks = await self.inner.get_into(
                self._keys([keys[i] for i in pending], level), [dests[i] for i in pending], force_latest=force_latest
            )
            seconds = time.perf_counter() - started
            filled = [i for i, ok in zip(pending, oks, strict=True) if ok]
            for i in filled:
                results[i] = True
            if filled:
                if level.lossy:
                    self.chooser.decoded(level, *self.coding.decoded(level))
                self.chooser.observe(level, len(filled), seconds)
                moved += len(filled) * self.coding.wire_bytes(level)
            pending = [i for i, ok in zip(pending, oks, strict=True) if not ok]
        return moved

    async def delete(self, keys: Sequence[bytes]) -> None:
        await self.inner.delete([key for level in self.config.levels for key in self._keys(keys, level)])

    def _keys(self, keys: Sequence[bytes], level: Level) -> list[bytes]:
        return list(keys) if level is Level.EXACT else [self.coding.key(key, level) for key in keys]

    # -- counters ---------------------------------------------------------------

    def tier_stats(self) -> dict[str, float]:
        """The inner tier's counters, and per level what it served (``LevelChooser.stats``)."""
        out = dict(self.inner.tier_stats())
        out.update(self.chooser.stats())
        return out

    def level_blocks(self) -> dict[str, int]:
        """Per level, the blocks this tier's reads filled so far; read from any thread (the loop adds levels and
        counts: a copy of the counts, each at most one chunk behind)."""
        return {level: counters.blocks for level, counters in list(self.chooser.counters.items())}

    def stats(self) -> dict[str, float | str]:
        out = dict(self.inner.stats())
        out.update(self.chooser.stats())
        return out


def _any_held(answers: Sequence[Presence]) -> Presence:
    """Held where any level is; unknown where none is and one could not tell; else absent."""
    if Presence.HELD in answers:
        return Presence.HELD
    return Presence.UNKNOWN if Presence.UNKNOWN in answers else Presence.ABSENT
