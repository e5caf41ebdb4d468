"""The bookkeeping behind one lock: every change to it, from the engine's calls and from the queues, in one place.

The bookkeeping (``tiercache.bookkeeping``) is pure and not thread-safe; the
engine's thread calls the facade while the background loop and the copy thread
report what landed. ``Books`` is the one owner of the lock: each method is one
short critical section over the slot tables, the hierarchy, the remote writes,
the lookup's pins, a load's plan and the cost model, ending with the moves it
caused handed to the mover. The queues see it as their ``Bookkeeper`` and the lanes as their
``LinkObserver``; neither holds the lock.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.load_plan import LoadItem, LoadPlanner
from tiercache.bookkeeping.memory_tiers import LookupPins, MemoryTiers, PinState
from tiercache.bookkeeping.moves import HostCopy, RemotePut
from tiercache.bookkeeping.remote_writes import RemoteWrites
from tiercache.manager.cost import CostModel
from tiercache.manager.lookup import Found, PrefixLookup
from tiercache.movement.loads import FillWaiters
from tiercache.movement.mover import Mover
from tiercache.movement.reads import RemoteRead
from tiercache.telemetry.counters import Metrics


class Books:
    """The thread-safe front of one topology's bookkeeping (see the module docstring)."""

    def __init__(
        self, local: MemoryTiers, hierarchy: Hierarchy, remote_writes: RemoteWrites, planner: LoadPlanner | None,
        lookup: PrefixLookup, cost: CostModel | None, mover: Mover, metrics: Metrics,
    ) -> None:
        self.local = local
        self.hierarchy = hierarchy
        self.remote_writes = remote_writes
        self.planner = planner
        self.lookup = lookup
        self.cost = cost
        self.mover = mover
        self.metrics = metrics
        self.waiters = FillWaiters()
        """Loads waiting for a CPU write in flight."""
        self.lock = threading.RLock()
        self._abandoned: deque[LookupPins] = deque()
        mover.books = self

    # ---- the engine's calls ----------------------------------------------------------------
    def find(self, keys: Sequence[bytes], *, local_only: bool, asker: Hashable | None = None, send: bool = True
             ) -> Found | None:
        """The lookup's answer (pinned), or None while a remote's answer is in flight."""
        with self.lock:
            self._reap()
            self.metrics.add("all", "lookups")
            return self.lookup.find(keys, local_only=local_only, asker=asker, send=send)

    def ask(self, keys: Sequence[bytes], asker: Hashable, *, send: bool = True) -> None:
        """Send (or, without ``send``, queue) the presence checks a later ``find`` by ``asker`` of ``keys`` needs."""
        with self.lock:
            self.lookup.ask(keys, asker, send=send)

    def flush_presence(self) -> None:
        """Send the presence checks queued since the last flush, as one batch."""
        with self.lock:
            if self.lookup.presence_cache is not None:
                self.lookup.presence_cache.flush()

    def forget(self, asker: Hashable) -> None:
        """``asker`` is done: the remote answers kept only for it go."""
        with self.lock:
            if self.lookup.presence_cache is not None:
                self.lookup.presence_cache.forget(asker)

    def answer_signal(self) -> threading.Event | None:
        """An event set once a presence check in flight answers, to wait on without the lock (None: none in
        flight)."""
        with self.lock:
            cache = self.lookup.presence_cache
            return cache.answer_signal() if cache is not None else None

    def abandon(self, pins: LookupPins) -> None:
        """A Lookup was dropped unused (from its finalizer, any thread): its lower pins go at the next call."""
        self._abandoned.append(pins)

    def allocate(self, count: int, chain: Sequence[bytes] | None) -> list[int]:
        """``count`` GPU blocks held by the engine (victims demoted by policy)."""
        with self.lock:
            self._reap()
            ids = self.hierarchy.allocate(count, chain)
            self.local.holds.give(ids)
            self.mover.dispatch()
            return ids

    def store(
        self, keys: Sequence[bytes], ids: Sequence[int], tokens: Any
    ) -> tuple[int, list[concurrent.futures.Future[bool]]]:
        """Index the engine's blocks (checked first); the number newly indexed and the copies it started."""
        with self.lock:
            held = self.local.holds.checked("store", ids)[: len(keys)]
            fresh = self.hierarchy.store(keys[: len(held)], held, tokens)
            return fresh, self.mover.dispatch()

    def plan_load(
        self, found: Found, keys: Sequence[bytes], ids: Sequence[int], force_latest: bool
    ) -> tuple[list[int], list[LoadItem]]:
        """Take over a Lookup's pins for a load into ``ids`` (checked first): the ids, and the load's plan."""
        with self.lock:
            held = self.local.holds.checked("load", ids)
            for block in held:
                if self.local.pool.key_of(block) is not None:
                    raise ValueError(f"load: GPU block {block} already holds KV (not a block fresh from allocate())")
            pins = found.pins
            pins.state = PinState.LOADED
            self.lookup.commit(found, keys)
            lower_keys = keys[len(pins.gpu_run) : len(found.tiers)]
            plan = [] if self.planner is None else self.planner.plan(lower_keys, held, pins.lower, force_latest)
            self.mover.dispatch()
            return held, plan

    def plan_fetch(self, found: Found, keys: Sequence[bytes], count: int, force_latest: bool) -> list[LoadItem]:
        """Take over a Lookup's pins to bring its first ``count`` blocks into CPU slots the engine copies out of
        itself (``LowerTiers``): the items, the rest of the Lookup's pins dropped."""
        with self.lock:
            pins = found.pins
            pins.state = PinState.LOADED
            self.lookup.commit(found, keys[:count])
            plan = self._planner.plan(keys, [None] * count, pins.lower, force_latest)
            self.mover.dispatch()
            return plan

    def begin_engine_writes(self, keys: Sequence[bytes]) -> list[int | None]:
        """CPU slots for blocks the engine copies in from its own pool (None: held already, not admitted, or no
        room)."""
        with self.lock:
            slots = self.hierarchy.begin_engine_writes(keys)
            self.mover.dispatch()  # write-backs of the victims that made room
            return slots

    def end_engine_writes(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        """The engine's copies into ``slots`` landed (or failed): commit them and write them down."""
        with self.lock:
            self.hierarchy.end_engine_writes(keys, slots, oks)
            self.waiters.ended(keys, oks)
            self.mover.dispatch()

    def release_lookup(self, found: Found) -> None:
        """Drop a Lookup's pins, its GPU run too."""
        with self.lock:
            self._reap()
            self.local.drop(found.pins, with_run=True)

    def reset_cpu(self) -> int:
        """Drop the CPU tier's entries nothing holds (``Hierarchy.reset_cpu_tier``); how many."""
        with self.lock:
            self._reap()
            return len(self.hierarchy.reset_cpu_tier())

    def release_blocks(self, ids: Sequence[int]) -> None:
        """The engine hands GPU blocks back (checked first)."""
        with self.lock:
            self._reap()
            self.local.holds.take_back(self.local.holds.checked("release", ids))

    def reap(self) -> None:
        with self.lock:
            self._reap()

    def _reap(self) -> None:
        """Drop the lower pins of Lookups the engine let go of without loading or releasing them."""
        while self._abandoned:
            if self.local.drop(self._abandoned.popleft(), with_run=False):
                self.metrics.add("all", "lookups_abandoned")

    # ---- the movers' reports (Bookkeeper) ----------------------------------------------------
    def copy_done(self, move: HostCopy, ok: bool, checksums: Sequence[int] | None = None) -> None:
        with self.lock:
            cpu = self.local.cpu
            if ok and checksums is not None and cpu is not None:
                for slot, checksum in zip(move.cpu_slots, checksums, strict=True):
                    cpu.note_checksum(slot, checksum)
            self.hierarchy.copy_done(move, ok)
            self.waiters.ended(move.keys, [ok] * len(move.keys))
            self.mover.dispatch()

    def put_done(self, move: RemotePut, oks: Sequence[bool]) -> None:
        with self.lock:
            self.remote_writes.put_done(move, oks)
            self.mover.dispatch()

    def evicted(self, lane: int, keys: Sequence[bytes]) -> None:
        with self.lock:
            self.remote_writes.evicted(lane, keys)

    def wait_for_write(self, key: bytes) -> concurrent.futures.Future[bool]:
        with self.lock:
            cpu = self.local.cpu
            if cpu is not None and cpu.writing(key):
                return self.waiters.wait_for(key)
            ended: concurrent.futures.Future[bool] = concurrent.futures.Future()  # the write ended before we asked
            ended.set_result(cpu is not None and cpu.readable(key) is not None)
            return ended

    def staged_read_ended(self, items: Sequence[LoadItem], read: RemoteRead) -> None:
        keys = [item.key for item in items]
        with self.lock:
            for tried in read.tried:
                told = read.late is None or tried is not read.tried[-1]  # a late lane did not say what it holds
                missed = [keys[i] for i in tried.missed] if told else []
                self.remote_writes.read_tried(tried.lane.index, [keys[i] for i in tried.positions], missed)
            self._planner.arrived(items, read.sources, read.unsettled)
            self.metrics.add(self.hierarchy.cpu_name, "blocks_in", sum(read.filled))
            self.waiters.ended(keys, read.filled)
            self.mover.dispatch()  # promotions into faster remotes start now, not at the engine's next call

    def late_read_ended(self, slots: Sequence[int]) -> None:
        with self.lock:
            self._planner.late_read_ended(slots)

    def fill_landed(self, item: LoadItem) -> bool:
        with self.lock:
            return self._planner.fill_landed(item)

    def handed_over(self, items: Sequence[LoadItem]) -> None:
        with self.lock:
            self._planner.handed_over(items)

    def release(self, items: Sequence[LoadItem]) -> None:
        with self.lock:
            self._planner.release(items)

    def written_clock(self) -> int:
        with self.lock:
            return self.remote_writes.written_clock()

    def found_absent(self, lane: int, keys: Sequence[bytes], clock: int) -> None:
        with self.lock:
            self.remote_writes.forget_absent(lane, keys, clock)

    def begin_explored(self, lane: int, keys: Sequence[bytes], oks: Sequence[bool]) -> list[tuple[int, int]]:
        name = self.remote_writes.lane_name(lane)
        with self.lock:
            cpu = self.local.cpu
            missed = [key for key, ok in zip(keys, oks, strict=True) if not ok]
            self.remote_writes.forget(lane, missed, proven=False)  # rewritten by the next store; routers are not told
            self.metrics.add(name, "explore_misses", len(missed))
            writes, dropped = [], 0
            for position, (key, ok) in enumerate(zip(keys, oks, strict=True)):
                if not ok or (cpu is not None and key in cpu):
                    continue
                slot = self.hierarchy.begin_remote_read(key)
                if slot is None:  # every slot pinned or being written: back-pressure
                    dropped += 1
                else:
                    writes.append((position, slot))
            self.metrics.add(name, "explore_dropped_blocks", dropped)
            return writes

    def end_explored(self, lane: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        with self.lock:
            self.hierarchy.end_remote_reads(slots, [True] * len(slots))
            self.waiters.ended(keys, [True] * len(keys))
            if keys:
                self.remote_writes.fetched(lane, keys, slots)
            self.metrics.add(self.remote_writes.lane_name(lane), "explored_blocks", len(keys))
            self.mover.dispatch()

    @property
    def _planner(self) -> LoadPlanner:
        if self.planner is None:
            raise RuntimeError("loads need a CPU tier")
        return self.planner

    # ---- the links' timings (LinkObserver) ----------------------------------------------------
    def presence_checked(self, tier: str, seconds: float) -> None:
        if self.cost is not None:
            with self.lock:
                self.cost.observe_presence_check(tier, seconds)

    def fetched(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        if self.cost is not None:
            with self.lock:
                self.cost.observe_fetch(tier, blocks, nbytes, seconds)

    def explored(self, tier: str, blocks: int, nbytes: int, seconds: float | None) -> None:
        if self.cost is not None:
            with self.lock:
                self.cost.exploration_ended(tier, blocks, nbytes, seconds)

    def recompute_seconds(self, tokens: int) -> float | None:
        if self.cost is None:
            return None
        with self.lock:
            return self.cost.expected_recompute_seconds(tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's prefill rate, for the cost model."""
        if self.cost is not None:
            with self.lock:
                self.cost.observe_prefill(tokens, seconds)
