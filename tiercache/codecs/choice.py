"""Which level each chunk of a fetch is read at: the cheapest to have in the slots, or recompute.

A chunk at a level costs the latency, then the slower of the link's time for that
level's bytes and the time to decode them (chunks in flight overlap one chunk's
decode with the next one's transfer). The link's time is the chunk's bytes over
the throughput the tier's reads delivered (a fetch's bytes so far over its time so
far, chunks in flight together, smoothed across chunks and fetches, so the next
chunk's choice sees the bandwidth the previous ones met); the latency is what the
shortest chunk seen took beyond that (before any chunk is timed, the shortest
presence check's round trip). Each level's decode rate is measured on this
process's decodes (all of them so far; a prior until then). The cheapest level
wins, unless even it would arrive later than the engine's prefill computes the
chunk's tokens: then the chunk, and so the rest of the prefix, is recomputed.

Why not the cost model's ``FetchFit``: a fetch's chunks are all one size, and
that fit, seeing one size, rightly takes a fetch's whole time as fixed cost (its
question is whether a tier is worth reading at all), which ranks a small level
no cheaper than a large one. The cost model gives this choice the engine's
prefill rate. Pure: no threads, no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiercache.codecs.levels import Level

PRIOR_BANDWIDTH_BYTES_PER_S = 1.25e8
"""The link's throughput before any read is timed (1 Gbit/s): a fetch's first chunks, before they are timed,
go at a middle level, not at the largest (a slow link) nor at the slowest to decode (a fast one)."""
THROUGHPUT_SMOOTHING = 0.5
"""Weight of the newest throughput measurement (the streamer follows the last chunks)."""
PRIOR_DECODE_BYTES_PER_S: Mapping[Level, float] = {
    Level.EXACT: 10e9, Level.INT8: 5e9, Level.COMPACT: 1.5e8,
}
"""Raw KV bytes decoded per second per core before this process decoded any (``speed_float32`` in
benchmarks/codec.json on the development machine, rounded down): exact is a copy."""


@dataclass
class LevelCounters:
    """What one level served."""

    chunks: int = 0
    blocks: int = 0
    wire_bytes: int = 0


@dataclass
class LevelChooser:
    """Picks each chunk's level (see the module docstring) and learns from what each chunk took."""

    levels: Sequence[Level]
    wire_bytes: Mapping[Level, float]
    """Bytes one block's value at each level moves over the link (header included)."""
    raw_bytes: int
    """The block's bytes (what a decode produces)."""
    throughput: float = PRIOR_BANDWIDTH_BYTES_PER_S
    latency_s: float = 0.0
    decode_rate: dict[Level, float] = field(default_factory=lambda: dict(PRIOR_DECODE_BYTES_PER_S))
    counters: dict[str, LevelCounters] = field(default_factory=dict)
    recomputed_chunks: int = 0
    recomputed_blocks: int = 0
    _shortest_s: float = math.inf
    _deliveries: int = 0

    def seconds(self, level: Level, blocks: int) -> float:
        """Expected time to have ``blocks`` blocks of ``level`` in their slots: the latency, then the slower of
        the link and the decode (chunks in flight overlap one's decode with the next one's transfer)."""
        link = self.wire_bytes[level] * blocks / self.throughput
        return self.latency_s + max(link, blocks * self.raw_bytes / self.decode_rate[level])

    def ranked(self, blocks: int) -> list[Level]:
        """The levels, cheapest first, for a chunk of ``blocks`` blocks."""
        return sorted(self.levels, key=lambda level: self.seconds(level, blocks))

    def choose(self, blocks: int, recompute_seconds: float | None) -> Level | None:
        """The level to read a chunk of ``blocks`` blocks at; None: recompute it (cheaper than any level)."""
        best = self.ranked(blocks)[0]
        if recompute_seconds is not None and self.seconds(best, blocks) > recompute_seconds:
            return None
        return best

    def observe(self, level: Level, blocks: int, seconds: float) -> None:
        """A chunk of ``blocks`` blocks at ``level`` arrived (and was decoded) in ``seconds``."""
        counters = self.counters.setdefault(level.value, LevelCounters())
        counters.chunks += 1
        counters.blocks += blocks
        counters.wire_bytes += int(self.wire_bytes[level] * blocks)
        if self.measured and blocks > 0 and 0 < seconds < self._shortest_s:  # the shortest waited least behind others
            # (before the link's throughput is measured, a chunk's time is no evidence of latency)
            self._shortest_s = seconds
            self.latency_s = 0.0
            self.latency_s = max(0.0, seconds - self.seconds(level, blocks))

    def round_trip(self, seconds: float) -> None:
        """A request with no payload (a presence check) took ``seconds``: until a read has timed the link, the
        shortest such is its latency, so the first chunk read teaches the throughput net of the round trip."""
        if not self.measured and seconds > 0 and (self.latency_s == 0 or seconds < self.latency_s):
            self.latency_s = seconds

    def decoded(self, level: Level, raw_bytes: int, seconds: float) -> None:
        """This process has decoded ``raw_bytes`` of ``level`` in ``seconds`` in all: the level's decode rate."""
        if raw_bytes > 0 and seconds > 0:
            self.decode_rate[level] = raw_bytes / seconds

    def delivered(self, nbytes: float, seconds: float) -> None:
        """A fetch has delivered ``nbytes`` over the link in its first ``seconds`` (chunks in flight together;
        its first round trip, the latency, is no part of the throughput)."""
        moving = seconds - self.latency_s
        if nbytes > 0 and moving > 0:
            weight = THROUGHPUT_SMOOTHING if self._deliveries else 1.0  # the first measurement replaces the prior
            self.throughput += weight * (nbytes / moving - self.throughput)
            self._deliveries += 1

    @property
    def measured(self) -> bool:
        """Whether any read has timed the link (else its throughput is the prior's)."""
        return self._deliveries > 0

    def recomputed(self, blocks: int) -> None:
        """A chunk of ``blocks`` blocks (and the rest of its fetch) was left to the engine to recompute."""
        self.recomputed_chunks += 1
        self.recomputed_blocks += blocks

    def stats(self) -> dict[str, float]:
        """Per level the chunks, blocks and bytes it served and its decode rate; the chunks recomputed; the link."""
        out: dict[str, float] = {"level_recompute_chunks": float(self.recomputed_chunks),
                                 "level_recompute_blocks": float(self.recomputed_blocks),
                                 "level_link_bytes_per_s": self.throughput, "level_link_latency_s": self.latency_s}
        for level in self.levels:
            counters = self.counters.get(level.value, LevelCounters())
            out[f"level_{level.value}_chunks"] = float(counters.chunks)
            out[f"level_{level.value}_blocks"] = float(counters.blocks)
            out[f"level_{level.value}_wire_bytes"] = float(counters.wire_bytes)
            out[f"level_{level.value}_decode_bytes_per_s"] = self.decode_rate[level]
        return out
