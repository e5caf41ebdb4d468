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

A call costs what it is asked about, never what is held (docs/architecture.md,
"Presence"): a key's answer, the bound on answers no asker keeps and a settled
batch are O(1) a key whatever the keys remembered or the batches in flight (a GPU
server holds hundreds of requests' keys while their checks are out). Batches that
answered are handed over by their futures' callbacks; those past ``give_up_s`` are
found oldest first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

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


class _Askers(set):  # type: ignore[type-arg]
    """Two or more askers keeping one key (one asker is kept as itself: most keys have one, and a set a key is
    two hundred bytes and an object the garbage collector scans)."""


@dataclass(eq=False, slots=True)
class _Entry:
    """What is known of one key: its batch until answered, then per lane its presence; who keeps it."""

    batch: _Batch | None
    presence: tuple[Presence, ...] | None = None
    askers: Hashable | _Askers | None = None
    """None, the one asker keeping it, or ``_Askers``."""

    def kept_by(self, asker: Hashable) -> bool:
        askers = self.askers
        return asker in askers if isinstance(askers, _Askers) else askers is not None and askers == asker

    def keep(self, asker: Hashable) -> None:
        askers = self.askers
        if askers is None:
            self.askers = asker
        elif isinstance(askers, _Askers):
            askers.add(asker)
        else:
            self.askers = _Askers((askers, asker))

    def let_go(self, asker: Hashable) -> None:
        askers = self.askers
        if isinstance(askers, _Askers):
            askers.discard(asker)
            if len(askers) == 1:
                self.askers = next(iter(askers))
        elif askers is not None and askers == asker:
            self.askers = None

    def keepers(self) -> tuple[Hashable, ...]:
        askers = self.askers
        return () if askers is None else tuple(askers) if isinstance(askers, _Askers) else (askers,)


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
        self._entries: dict[bytes, _Entry] = {}
        self._unkept: OrderedDict[bytes, None] = OrderedDict()
        """The remembered keys no asker keeps, oldest first: the only ones ``_bound`` drops."""
        self._asked: dict[Hashable, set[bytes]] = {}
        """Per asker, the remembered keys it keeps."""
        self._pending = _Batch([])
        self._in_flight: OrderedDict[_Batch, None] = OrderedDict()
        """Batches sent and not yet applied, in the order they were sent (the oldest is the first to give up on)."""
        self._landed: deque[_Batch] = deque()
        """Batches whose answer came, appended by their futures' callbacks (any thread), applied at ``flush``."""
        self._answered = threading.Event()
        """Set when a batch in flight answers (``answer_signal``)."""
        self.counts: Counter[Presence] = Counter()
        """Keys answered, by their combined presence (``combined``), counted once per batch."""

    def answer(self, keys: Sequence[bytes], asker: Hashable | None = None, *, send: bool = True) -> Answers | None:
        """Per lane, each key's presence; None while any of ``keys`` is in flight."""
        asked = None if asker is None else self._asked.setdefault(asker, set())
        entries = [self._entry(key, asker, asked) for key in keys]
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
            if entry.askers is None or Presence.UNKNOWN in presence:
                self._drop(key)
        return answers

    def _entry(self, key: bytes, asker: Hashable | None, asked: set[bytes] | None) -> _Entry:
        """The entry of ``key``, new in the pending batch if unknown, kept for ``asker`` (whose keys are ``asked``)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(self._pending)
            self._pending.keys.append(key)
            if asker is None:
                self._unkept[key] = None
            self._bound()
        elif asker is not None and entry.askers is None:
            self._unkept.pop(key, None)
        if asked is not None and not entry.kept_by(asker):
            entry.keep(asker)
            asked.add(key)
        return entry

    def flush(self) -> None:
        """Send the pending keys as one batch; settle batches that answered or passed ``give_up_s``."""
        while self._landed:
            self._settle(self._landed.popleft())
        now = time.monotonic()
        while self._in_flight:
            oldest = next(iter(self._in_flight))
            if now - oldest.sent <= self.give_up_s or not self._settle(oldest):
                break
        self._send(now)

    def _send(self, now: float) -> None:
        """Send the pending keys as one batch (nothing when none is pending)."""
        batch, self._pending = self._pending, _Batch([])
        if batch.keys:
            batch.future, batch.sent = self.runtime.submit(self._ask(list(batch.keys))), now
            self._in_flight[batch] = None
            batch.future.add_done_callback(lambda _, landed=batch: self._land(landed))

    def _land(self, batch: _Batch) -> None:
        """A batch's answer came (on the thread that finished it): the next ``flush`` applies it."""
        self._landed.append(batch)
        self._answered.set()

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
        if batch not in self._in_flight:
            return True  # applied already
        if future.done():
            try:
                answers = future.result()
            except BaseException:  # a cancelled batch (closing) reads as 'could not tell'
                answers = [[Presence.UNKNOWN] * len(batch.keys) for _ in self.lanes]
        elif time.monotonic() - batch.sent > self.give_up_s:
            answers = [[Presence.UNKNOWN] * len(batch.keys) for _ in self.lanes]
        else:
            return False
        del self._in_flight[batch]
        for position, key in enumerate(batch.keys):
            self.counts[combined(answers, position)] += 1
            entry = self._entries.get(key)
            if entry is not None and entry.batch is batch:
                entry.batch, entry.presence = None, tuple(answer[position] for answer in answers)
        return True

    def mark_absent(self, keys: Sequence[bytes]) -> None:
        """A read of ``keys`` failed: answer them not held while their askers run."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.presence is not None:
                entry.presence = (Presence.ABSENT,) * len(self.lanes)

    def forget(self, asker: Hashable) -> None:
        """``asker`` is done: drop what only it kept (an answer still in flight stays, kept by no one, until read or
        bounded)."""
        for key in self._asked.pop(asker, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.let_go(asker)
            if entry.askers is not None:
                continue
            if entry.batch is None:
                self._drop(key)
            else:
                self._unkept[key] = None

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._unkept.pop(key, None)
            for asker in entry.keepers():
                self._asked.get(asker, set()).discard(key)

    def _bound(self) -> None:
        """Drop the oldest answers no asker keeps while more than ``max_keys`` are remembered."""
        while len(self._entries) > self.max_keys and self._unkept:
            del self._entries[self._unkept.popitem(last=False)[0]]

    def answer_signal(self) -> threading.Event | None:
        """An event set once a batch in flight has answered (set already if one has, not yet applied); None when
        none is in flight. Keys still pending are sent first. A caller waits on it outside its lock, then asks
        again."""
        self._send(time.monotonic())
        if not self._in_flight:
            return None
        self._answered.clear()  # cleared before looking, so an answer landing meanwhile still sets it
        if self._landed:
            self._answered.set()
        return self._answered

    def __len__(self) -> int:
        """Keys remembered: kept by an asker, in flight, or answered and not read yet."""
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def busy(self) -> bool:
        """Keys waiting to be sent or in flight."""
        return bool(self._pending.keys or self._in_flight)
