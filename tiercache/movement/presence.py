"""The presence cache: remote lookups asked in the background and answered from memory, per key.

Every remote lookup goes through one ``PresenceCache``: the manager's lookup, and
through ``RemoteStore.presence`` the engines' adapters (vLLM asks its tiers one key
at a time, every step a request waits). ``answer`` never waits on the network:

* a key not known yet joins the pending batch, sent at once (``send=True``) or at
  the next ``flush`` (an adapter sends one batch per scheduler step), and the
  answer is None while any key asked is in flight;
* a batch answers per lane and key (``HELD``, ``ABSENT`` or ``UNKNOWN``: a lane
  that could not tell); one not answered within ``give_up_s`` counts as
  ``UNKNOWN`` whatever the network does;
* an answer is kept while an asker that asked for it (a request id) has not
  ``forget``-ten it; one asked without an asker is consumed by that read, so the
  next lookup asks again. ``UNKNOWN`` is never kept: the next asker asks anew;
* a key is one block of one chain, so askers share answers per key, never a
  different prompt's (a key names its whole prefix).

``key_map`` maps the keys as asked into the keys the tiers store, on the
background loop (an adapter asks by the engine's own block keys). Not
thread-safe: call it from one thread at a time (the caller's lock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from tiercache.movement.lanes import Lane
from tiercache.movement.runtime import Runtime
from tiercache.tiers.base import Presence

GIVE_UP_FACTOR = 5.0
"""A batch not answered within this many remote-lookup timeouts counts as UNKNOWN (a lane's own deadline is
one timeout plus its queue; this bounds what a lookup sees if anything below misbehaves)."""
MAX_REMEMBERED_KEYS = 1 << 16
"""Answers kept for no asker (asked, then never asked again) before the oldest are dropped."""

Answers = list[list[Presence]]
"""Per lane, per key asked: its presence."""


@dataclass(eq=False)
class _Batch:
    """Keys sent as one batch (one ``contains`` per lane): the future of every lane's answer, when it was sent."""

    keys: list[bytes]
    future: concurrent.futures.Future[Answers] | None = None
    sent: float = 0.0


@dataclass(eq=False)
class _Entry:
    """What is known of one key: its batch until answered, then per lane its presence."""

    batch: _Batch | None
    presence: tuple[Presence, ...] | None = None
    askers: set[Hashable] = field(default_factory=set)


def first_holder(answers: Sequence[Sequence[Presence]], position: int) -> int | None:
    """The first (fastest) lane whose answer says it holds the key at ``position``, or None."""
    for lane, answer in enumerate(answers):
        if answer[position] is Presence.HELD:
            return lane
    return None


def combined(answers: Sequence[Sequence[Presence]], position: int) -> Presence:
    """Every lane's answer for one key as one: HELD if any holds it, ABSENT only if every lane said so."""
    if first_holder(answers, position) is not None:
        return Presence.HELD
    return Presence.ABSENT if all(answer[position] is Presence.ABSENT for answer in answers) else Presence.UNKNOWN


class PresenceCache:
    """Remote lookups answered from memory (see the module docstring)."""

    def __init__(
        self, lanes: Sequence[Lane], runtime: Runtime, *,
        key_map: Callable[[list[bytes]], list[bytes]] | None = None, max_keys: int = MAX_REMEMBERED_KEYS,
    ) -> None:
        self.lanes = list(lanes)
        self.runtime = runtime
        self.give_up_s = GIVE_UP_FACTOR * max((lane.lookup_timeout_s for lane in self.lanes), default=0.0)
        self.key_map = key_map
        self.max_keys = max_keys
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._asked: dict[Hashable, set[bytes]] = {}
        self._pending = _Batch([])
        self._in_flight: list[_Batch] = []
        self.counts: Counter[Presence] = Counter()
        """Keys answered, by their combined presence (``combined``), counted once per batch."""

    def answer(self, keys: Sequence[bytes], asker: Hashable | None = None, *, send: bool = True) -> Answers | None:
        """Per lane, each key's presence; None while any of ``keys`` is in flight."""
        entries = [self._entry(key, asker) for key in keys]
        if send:
            self.flush()
        if any(entry.presence is None and not self._settle(entry.batch) for entry in entries):
            return None
        answers: Answers = [[] for _ in self.lanes]
        for key, entry in zip(keys, entries, strict=True):
            presence = entry.presence
            assert presence is not None
            for lane, found in enumerate(presence):
                answers[lane].append(found)
            if not entry.askers or Presence.UNKNOWN in presence:
                self._drop(key)
        return answers

    def _entry(self, key: bytes, asker: Hashable | None) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(self._pending)
            self._pending.keys.append(key)
            self._bound()
        if asker is not None and asker not in entry.askers:
            entry.askers.add(asker)
            self._asked.setdefault(asker, set()).add(key)
        return entry

    def flush(self) -> None:
        """Send the pending keys as one batch; settle batches that answered or passed ``give_up_s``."""
        for batch in list(self._in_flight):
            self._settle(batch)
        batch, self._pending = self._pending, _Batch([])
        if batch.keys:
            batch.future, batch.sent = self.runtime.submit(self._ask(list(batch.keys))), time.monotonic()
            self._in_flight.append(batch)

    async def _ask(self, keys: list[bytes]) -> Answers:
        stored = self.key_map(keys) if self.key_map is not None else keys
        return list(await asyncio.gather(*(lane.contains(stored) for lane in self.lanes)))

    def _settle(self, batch: _Batch | None) -> bool:
        """Apply ``batch``'s answer once it has one (or gave up); False while it is in flight or unsent."""
        if batch is None:
            return True
        future = batch.future
        if future is None:
            return False
        if future.done():
            try:
                answers = future.result()
            except BaseException:  # a cancelled batch (closing) reads as 'could not tell'
                answers = [[Presence.UNKNOWN] * len(batch.keys) for _ in self.lanes]
        elif time.monotonic() - batch.sent > self.give_up_s:
            answers = [[Presence.UNKNOWN] * len(batch.keys) for _ in self.lanes]
        else:
            return False
        for position, key in enumerate(batch.keys):
            self.counts[combined(answers, position)] += 1
            entry = self._entries.get(key)
            if entry is not None and entry.batch is batch:
                entry.batch, entry.presence = None, tuple(answer[position] for answer in answers)
        if batch in self._in_flight:
            self._in_flight.remove(batch)
        return True

    def mark_absent(self, keys: Sequence[bytes]) -> None:
        """A read of ``keys`` failed: answer them not held while their askers run."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.presence is not None:
                entry.presence = (Presence.ABSENT,) * len(self.lanes)

    def forget(self, asker: Hashable) -> None:
        """``asker`` is done: drop what only it kept (answers in flight stay until they land)."""
        for key in self._asked.pop(asker, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.askers.discard(asker)
            if not entry.askers and entry.batch is None:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            for asker in entry.askers:
                self._asked.get(asker, set()).discard(key)

    def _bound(self) -> None:
        """Drop the oldest answers no asker keeps once more than ``max_keys`` are remembered."""
        excess = len(self._entries) - self.max_keys
        for key in [key for key, entry in self._entries.items() if not entry.askers][: max(excess, 0)]:
            self._drop(key)

    def answers_in_flight(self) -> list[concurrent.futures.Future[Answers]]:
        """The futures of the batches sent and not yet applied: a caller may wait on them (outside its lock), then
        ask again."""
        return [batch.future for batch in self._in_flight if batch.future is not None]

    @property
    def busy(self) -> bool:
        """Keys waiting to be sent or in flight."""
        return bool(self._pending.keys or self._in_flight)
