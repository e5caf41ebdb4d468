"""The remote lanes' writes: the puts their write policies ask for, the puts in flight, what each lane holds.

Pure: no threads, no I/O, no bytes; call it under the manager's lock. It turns
"landed in the CPU tier", "evicted from it", "hit" and "read from a lane" into
``RemotePut`` moves in the outbox, each lane by its write policy
(docs/architecture.md, "Hierarchy"):

* ``write_through``: a block as soon as it lands in the CPU tier;
* ``write_back``: a CPU victim the lane does not hold yet keeps its slot,
  pinned, until its put lands (``write_back_lanes``, ``write_back``); when the
  store queue is full it is dropped (counted), never copied aside
  (docs/architecture.md, "Entry state");
* ``write_through_selective``: once the block was hit ``admit_after_hits``
  times (``admit_on_hit``), on a landing and on an eviction alike;
* a block read from a slower lane is written into the faster lanes above it.

Keys are remembered as written per lane (``WrittenKeys``), and forgotten when a
read of them fails, so the next store rewrites a value that was lost or
corrupted (a damaged one: docs/architecture.md, "Failure, bad input and
security"). Routers hear of a remote's blocks as they land or are served, and
of their removal only when the remote says so (an answer of "not held", its own
eviction report), never because a read or a presence check failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.bookkeeping.admission import FillRule, HitCounts, WritePolicy
from tiercache.bookkeeping.moves import Outbox, Reason, RemotePut
from tiercache.bookkeeping.slots import SlotTable
from tiercache.bookkeeping.written_keys import WrittenKeys
from tiercache.telemetry.counters import Metrics
from tiercache.telemetry.observer import TierObserver


class RemoteWrites:
    """Per remote lane (fastest first): its write policy's puts, the puts in flight, the keys known written there."""

    def __init__(
        self,
        cpu: SlotTable | None,
        lanes: Sequence[FillRule],
        hits: HitCounts,
        outbox: Outbox,
        metrics: Metrics,
        observer: TierObserver,
        *,
        cpu_name: str,
        bytes_per_block: int,
        max_pending_stores: int,
        remember_keys: int,
    ) -> None:
        """``cpu``: the CPU tier's table, whose slots the puts read (None only with no lanes); ``hits``: the
        hit counts selective admission reads, shared with the ``Hierarchy``."""
        self._cpu = cpu
        self._lanes = list(lanes)
        self._hits = hits
        self._outbox = outbox
        self._metrics = metrics
        self._observer = observer
        self._cpu_name = cpu_name
        self._bytes_per_block = bytes_per_block
        self._max_pending_stores = max_pending_stores
        self._pending_stores = 0
        self._written = WrittenKeys(len(self._lanes), remember_keys)
        """Per lane, the keys known written there (its ``landings`` is the clock of "not held" answers)."""
        self._putting: list[dict[bytes, bool]] = [{} for _ in self._lanes]
        """Per lane, the keys with a put in flight, and whether the remote reported dropping them meanwhile."""

    @property
    def pending_stores(self) -> int:
        """Blocks queued or in flight to the remotes (bounded by ``queues.max_pending_stores``)."""
        return self._pending_stores

    def lane_name(self, lane: int) -> str:
        """The remote tier at ``lane`` (counters and events are kept under its name)."""
        return self._lanes[lane].name

    @property
    def _table(self) -> SlotTable:
        if self._cpu is None:
            raise RuntimeError("remote tiers need a CPU tier")
        return self._cpu

    # ---- what each lane holds ------------------------------------------------------------
    def written(self, lane: int, key: bytes) -> bool:
        """Whether ``key`` is remembered as stored in ``lane``."""
        return self._written.holds(lane, key)

    def written_clock(self) -> int:
        """The clock of what the lanes were seen to hold (``WrittenKeys.landings``): a "not held" answer given at
        an earlier tick is stale for a key seen since."""
        return self._written.landings

    def forget(self, lane: int, keys: Sequence[bytes], *, proven: bool = True) -> None:
        """The remote may have lost these keys: the next store writes them again.

        ``proven``: the remote said so (it answered "not held", or reported dropping
        them), and they are reported removed; else (a read failed) nothing is reported.
        """
        self._written.forget(lane, keys)
        if proven:
            self._observer.removed(self._lanes[lane].name, keys)

    def forget_absent(self, lane: int, keys: Sequence[bytes], clock: int) -> None:
        """``lane`` answered, when ``written_clock`` read ``clock``, that it does not hold ``keys``: forget them and
        report them removed, but for those seen there since (stored again meanwhile)."""
        self.forget(lane, [key for key in keys if not self._written.landed_since(lane, key, clock)])

    def read_tried(self, lane: int, asked: Sequence[bytes], missed: Sequence[bytes]) -> None:
        """A load's read asked ``lane`` for ``asked`` (an access of each); those it ``missed`` may be lost there:
        forgotten, so the next store rewrites them, but not reported removed (a failed read proves nothing)."""
        self.forget(lane, missed, proven=False)
        self._observer.accessed(self._lanes[lane].name, asked)

    def evicted(self, lane: int, keys: Sequence[bytes]) -> None:
        """The remote at ``lane`` dropped ``keys`` by itself: forget them (those with a put in flight once it
        has landed, or the put's landing would remember them again)."""
        putting = self._putting[lane]
        settled = []
        for key in keys:
            if key in putting:
                putting[key] = True
            else:
                settled.append(key)
        self.forget(lane, settled)

    def fetched(self, lane: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Blocks read from ``lane`` into CPU slots: known there; written into the faster lanes above it."""
        self._written.landed(lane, keys)
        self._observer.stored(self._lanes[lane].name, keys, None, None)  # served: held, whatever was said before
        for faster in range(lane):
            self._write_through(faster, keys, slots, Reason.PROMOTION)

    # ---- what the write policies ask for -------------------------------------------------------
    def write_through(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Blocks landed in the CPU tier: put them to every lane that admits them now (not from an eviction)."""
        for lane in range(len(self._lanes)):
            self._write_through(lane, keys, slots, Reason.WRITE_THROUGH)

    def admit_on_hit(self, key: bytes, slot: int, hits: int) -> None:
        """``key``, readable in CPU ``slot``, was just hit for the ``hits``-th time: put it to the selective lanes
        whose threshold that is."""
        for lane, rule in enumerate(self._lanes):
            selective = rule.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
            if selective and hits == rule.admit_after_hits and not self.written(lane, key):
                self._put(lane, [key], [slot], Reason.ADMITTED)

    def owes(self, key: bytes) -> bool:
        """Whether some lane still needs ``key`` from the CPU tier (not known written there, admitted on eviction)."""
        return any(self._owes(lane, key) for lane in range(len(self._lanes)))

    def write_back_lanes(self, key: bytes) -> list[int]:
        """The lanes a CPU victim must still be written to, within the store queue's room (a lane without room
        is counted ``stores_dropped``)."""
        lanes = []
        for lane, rule in enumerate(self._lanes):
            if not self._owes(lane, key):
                continue
            if self._pending_stores + len(lanes) >= self._max_pending_stores:
                self._metrics.add(rule.name, "stores_dropped")
                continue
            lanes.append(lane)
        return lanes

    def write_back(self, key: bytes, slot: int, lanes: Sequence[int]) -> None:
        """Put a CPU victim kept in ``slot`` (held once by its eviction) to ``lanes`` (``write_back_lanes``): the
        slot frees when the last put lands."""
        for _ in lanes[1:]:
            self._table.pin(slot)
        for lane in lanes:
            self._pending_stores += 1
            self._queue(RemotePut(lane, (key,), (slot,), Reason.DEMOTION, (self._table.checksum(slot),)))

    def _owes(self, lane: int, key: bytes) -> bool:
        return not self.written(lane, key) and self._lanes[lane].admits(self._hits[key], evicted=True)

    def _write_through(self, lane: int, keys: Sequence[bytes], slots: Sequence[int], reason: Reason) -> None:
        """Put the CPU slots of the keys ``lane`` does not hold yet and admits now (not from an eviction)."""
        rule = self._lanes[lane]
        todo = [
            (key, slot)
            for key, slot in zip(keys, slots, strict=True)
            if not self.written(lane, key) and rule.admits(self._hits[key], evicted=False)
        ]
        if todo:
            self._put(lane, [key for key, _ in todo], [slot for _, slot in todo], reason)

    def _put(self, lane: int, keys: list[bytes], slots: list[int], reason: Reason) -> None:
        """Queue a put of readable CPU slots (pinned until it lands), or drop it when the queue is full."""
        cpu = self._table
        if self._pending_stores + len(keys) > self._max_pending_stores:
            self._metrics.add(self._lanes[lane].name, "stores_dropped", len(keys))
            return
        for slot in slots:
            cpu.pin(slot)
        self._pending_stores += len(keys)
        self._queue(RemotePut(lane, tuple(keys), tuple(slots), reason, tuple(cpu.checksum(slot) for slot in slots)))

    def _queue(self, move: RemotePut) -> None:
        """A put for the outbox; its keys are in flight to the lane until ``put_done``."""
        putting = self._putting[move.lane]
        for key in move.keys:
            putting[key] = False
        self._outbox.add(move)

    # ---- the mover's report --------------------------------------------------------------------
    def put_done(self, move: RemotePut, oks: Sequence[bool]) -> None:
        """A put landed: unpin its slots (a write-back victim's slot frees), remember what was written; a key the
        remote reported dropping while its put was in flight is forgotten now."""
        cpu = self._table
        putting = self._putting[move.lane]
        dropped = [key for key in move.keys if putting.pop(key, False)]
        for slot in move.cpu_slots:
            cpu.unpin(slot)
        self._pending_stores -= len(move.keys)
        landed = [key for key, ok in zip(move.keys, oks, strict=True) if ok]
        self._written.landed(move.lane, landed)
        name = self._lanes[move.lane].name
        self._observer.accessed(name, move.keys)
        self._observer.stored(name, landed, None, None)
        stored = len(landed)
        self._metrics.add(self._cpu_name, "blocks_out", stored)
        self._metrics.add(name, "blocks_in", stored)
        self._metrics.add(name, "store_failures", len(move.keys) - stored)
        self._metrics.add(name, "bytes_written", stored * self._bytes_per_block)
        if dropped:
            self.forget(move.lane, dropped)
