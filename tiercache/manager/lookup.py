"""The lookup: which tier serves each block of a prompt, position by position, and the pins that keep it so.

The one part that reads where a prompt's blocks are: the local tiers' slot
tables, the presence cache's answers and the cost model's predictions. For a
prompt's keys it answers, per position of the longest prefix held by all tiers
together, the fastest tier holding the block (a block resident on the GPU is
never fetched from below), cut before the first remote tier slower to fetch
from than recomputing (the cost cut), and pins every local block it counts.

The pins are its only side effect, so a scheduler may look up as often as it
likes. What a lookup finds out rides on its answer (``Learned``) and is told
once per request, by ``commit`` at load: the remote tiers' "not held" answers
(``RemoteWrites`` forgets those keys, so a store rewrites them) and the cost
model's verdicts (its counters and exploration schedule); an exploration the
cost model then starts is handed, with the remote blocks it cut, to the
background (``explore``), never to the request's load. A remote that could
not tell (timeout, open breaker, error: ``Presence.UNKNOWN``) serves nothing in
this answer and is never taken as "not held".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.memory_tiers import LookupPins, MemoryTiers, Place, Source
from tiercache.bookkeeping.remote_writes import RemoteWrites
from tiercache.manager.cost import CostModel, Verdict
from tiercache.movement.presence import PresenceCache, first_holder
from tiercache.tiers.base import Presence


@dataclass(frozen=True)
class TierNames:
    """The names the answer counts blocks under, fastest first."""

    gpu: str | None
    """None where the engine keeps its own pool (``LowerTiers``)."""
    cpu: str | None
    remotes: tuple[str, ...]

    @functools.cached_property
    def all(self) -> tuple[str, ...]:
        """Every tier's name, fastest first (taken once: every lookup counts its blocks under them)."""
        return (*([self.gpu] if self.gpu else []), *([self.cpu] if self.cpu else []), *self.remotes)

    def of(self, place: Place) -> str:
        """The tier serving a place of a prefix."""
        if place.source is Source.GPU:
            assert self.gpu is not None
            return self.gpu
        if place.source is Source.REMOTE:
            return self.remotes[place.index]
        assert self.cpu is not None
        return self.cpu


@dataclass(frozen=True)
class Learned:
    """What one lookup found out, told once per request at load (``PrefixLookup.commit``)."""

    absent: tuple[tuple[int, tuple[bytes, ...]], ...] = ()
    """Per remote lane, the keys it answered it does not hold."""
    clock: int = 0
    """``RemoteWrites.written_clock`` when the lookup was answered: a key seen in a remote since is not forgotten."""
    verdicts: tuple[tuple[str, Verdict | None], ...] = ()
    """The cost model's verdict on each remote tier it weighed."""
    cut_blocks: tuple[tuple[int, tuple[bytes, ...]], ...] = ()
    """Per remote lane with an ``EXPLORE`` verdict, the keys of the blocks the cost cut took from it."""


@dataclass
class Found:
    """A lookup's answer: per position of the prefix, the serving tier; the pins; what it learned."""

    tiers: list[str]
    pins: LookupPins
    tier_blocks: dict[str, int]
    """Blocks served per tier (every tier named, zeros included)."""
    learned: Learned = field(default_factory=Learned)


class PrefixLookup:
    """Answers, position by position, which tier serves each block of a prompt (see the module docstring).

    Call under the manager's lock.
    """

    def __init__(
        self,
        local: MemoryTiers,
        presence_cache: PresenceCache | None,
        hierarchy: Hierarchy,
        remote_writes: RemoteWrites,
        cost: CostModel | None,
        names: TierNames,
        block_size: int,
    ) -> None:
        self.local = local
        self.presence_cache = presence_cache
        self.hierarchy = hierarchy
        self.remote_writes = remote_writes
        self.cost = cost
        self.names = names
        self.block_size = block_size
        self.explore: Callable[[int, Sequence[bytes]], None] | None = None
        """Starts an exploration of (lane, keys) in the background (``Explorer.start``)."""

    def find(self, keys: Sequence[bytes], *, local_only: bool = False, asker: Hashable | None = None,
             send: bool = True) -> Found | None:
        """The prefix of ``keys`` the tiers can serve, pinned; None while a remote's answer is in flight.

        ``local_only``: GPU and CPU only (remote tiers count as misses), never None. ``asker``: the remote
        answers are kept for it (a request looking up again) until the presence cache ``forget``s it. ``send``: a
        key not asked before is sent now, else at the presence cache's next ``flush``.
        """
        places = self.local.locate(keys)
        absent: tuple[tuple[int, tuple[bytes, ...]], ...] = ()
        missing = [key for key, place in zip(keys, places, strict=True) if place is None]
        if missing and self.presence_cache is not None and self.presence_cache.lanes and not local_only:
            answers = self.presence_cache.answer(missing, asker, send=send)
            if answers is None:
                return None
            holders = (first_holder(answers, position) for position in range(len(missing)))
            places = [place if place is not None else Place.remote(next(holders)) for place in places]
            absent = tuple(
                (lane, tuple(key for key, found in zip(missing, answer, strict=True) if found is Presence.ABSENT))
                for lane, answer in enumerate(answers)
            )
        places, verdicts, cut_blocks = self._cost_cut(keys, places)
        run, lower = self.local.prefix(places)
        pins = self.local.hold(run, lower)
        tiers = [self.names.of(Place(Source.GPU, 0))] * len(run) if run else []
        tiers += [self.names.of(place) for place in lower]
        tier_blocks = dict.fromkeys(self.names.all, 0)
        for name in tiers:
            tier_blocks[name] += 1
        absent = tuple((lane, keys) for lane, keys in absent if keys)
        learned = Learned(absent, self.remote_writes.written_clock(), tuple(verdicts), cut_blocks)
        return Found(tiers, pins, tier_blocks, learned)

    def ask(self, keys: Sequence[bytes], asker: Hashable, *, send: bool = True) -> None:
        """Send the presence checks of the keys no local tier holds, answers kept for ``asker``: a later ``find``
        of any of them answers from memory (a request that will look up several ends asks once)."""
        if self.presence_cache is None or not self.presence_cache.lanes:
            return
        missing = [key for key, place in zip(keys, self.local.locate(keys), strict=True) if place is None]
        if missing:
            self.presence_cache.answer(missing, asker, send=send)

    def commit(self, found: Found, keys: Sequence[bytes]) -> None:
        """The request goes ahead with ``found`` (its load): count its hits, tell what it learned, once."""
        self.hierarchy.count_hits(keys[: len(found.tiers)], found.tier_blocks, len(keys))
        learned = found.learned
        for lane, absent in learned.absent:
            self.remote_writes.forget_absent(lane, absent, learned.clock)
        if self.cost is None:
            return
        cut_blocks = dict(learned.cut_blocks)
        for tier, verdict in learned.verdicts:
            if self.cost.count(tier, verdict) is not Verdict.EXPLORE:
                continue
            lane = self.names.remotes.index(tier)
            if self.explore is not None and cut_blocks.get(lane):
                self.explore(lane, cut_blocks[lane])
            else:
                self.cost.exploration_ended(tier)

    def _cost_cut(
        self, keys: Sequence[bytes], places: list[Place | None]
    ) -> tuple[list[Place | None], list[tuple[str, Verdict | None]], tuple[tuple[int, tuple[bytes, ...]], ...]]:
        """The places cut before the first remote tier slower to fetch from than recomputing; the verdicts;
        per lane explored, the keys of the blocks it would have served before the cut."""
        if self.cost is None:
            return places, [], ()
        runs: list[tuple[str | None, int]] = []
        for place in places:
            if place is None:
                break
            tier = self.names.remotes[place.index] if place.source is Source.REMOTE else None
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + 1)
            else:
                runs.append((tier, 1))
        usable, verdicts = self.cost.cut(runs, self.block_size)
        held = sum(blocks for _, blocks in runs)
        explored = [self.names.remotes.index(tier) for tier, verdict in verdicts if verdict is Verdict.EXPLORE]
        cut_blocks = tuple(
            (lane, tuple(keys[i] for i in range(usable, held) if places[i] == Place(Source.REMOTE, lane)))
            for lane in explored
        )
        return places[:usable] + [None] * (len(places) - usable), verdicts, cut_blocks


@dataclass
class Lookup:
    """The cached prefix of a prompt, tier by tier.

    ``tier_blocks`` counts the blocks of the longest prefix held by all tiers
    together, by the tier that serves each position (the fastest holder).
    ``gpu_block_ids`` are the GPU blocks already holding the prefix's leading
    blocks; they are pinned for the caller, who hands them back with ``release``
    (with the rest of its block table). Every other local block the Lookup counts
    is pinned too, until ``load`` takes those pins over or ``release(hit)`` drops
    them all (a Lookup dropped unused gives its lower pins back by itself).
    ``pending`` is True while a remote tier's answer is in flight: call
    ``lookup`` again later (nothing is pinned meanwhile).
    """

    keys: list[bytes]
    block_size: int
    tier_blocks: dict[str, int]
    gpu_block_ids: list[int]
    pending: bool = False
    tiers: list[str] = field(default_factory=list)
    """Per position of the prefix, the name of the tier that serves it."""
    found: Any = field(default=None, repr=False, compare=False)
    """The lookup's answer behind this handle (``tiercache.manager.lookup.Found``: its pins and what it learned)."""
    drop_guard: Any = field(default=None, repr=False, compare=False)
    """Gives the lower pins back when the Lookup is dropped unused (it lives as long as the Lookup)."""

    @property
    def num_blocks(self) -> int:
        """Blocks of the longest cached prefix, over all tiers."""
        return sum(self.tier_blocks.values())

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_lower_blocks(self) -> int:
        """Blocks that ``load`` would bring into the GPU pool."""
        return self.num_blocks - len(self.gpu_block_ids)
