"""The hierarchy: the one place that reads write policies, admission and ``exclusive``.

Pure: it changes slot tables and counters under the manager's lock and turns
"stored / evicted / committed / loaded" into moves (``tiercache.bookkeeping.moves``) in its
``outbox``; the manager runs them and reports back through ``copy_done`` and
``put_done``. Rules:

* A tier's write policy says how it is filled from the tier above:
  ``write_through`` on store, ``write_back`` on eviction only,
  ``write_through_selective`` once a block was hit ``admit_after_hits`` times,
  on store and on demotion alike (a demoted block below the threshold is
  dropped and counted as ``not_admitted``); a block read from a slower remote
  is written into the faster remotes above it (docs/architecture.md, "Hierarchy").
* A hit counts once per request, when the engine loads it (``count_hits``), never per lookup (``admission``;
  docs/architecture.md, "Eviction order and prefixes").
* A CPU victim that a remote still needs keeps its slot, pinned, until its put
  lands; when the store queue is full it is dropped (counted), never copied aside (docs/architecture.md, "Entry state").
* Keys are remembered as written per remote lane (``written_keys``), and forgotten when a read of
  them fails, so the next store rewrites a value that was lost or corrupted (a damaged one:
  docs/architecture.md, "Failure, bad input and security").
  Routers hear of a remote's blocks as they land or are served, and of their
  removal only when the remote says so (an answer of "not held", its own
  eviction report), never because a read or a probe failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.bookkeeping.admission import FillRule, HitCounts, WritePolicy
from tiercache.bookkeeping.memory_tiers import MemoryTiers
from tiercache.bookkeeping.moves import HostCopy, Move, Reason, RemotePut
from tiercache.bookkeeping.slots import CapacityError
from tiercache.bookkeeping.written_keys import WrittenKeys
from tiercache.telemetry.counters import Metrics
from tiercache.telemetry.observer import NullObserver, TierObserver, report_stored_runs


class Hierarchy:
    """Write policies, admission, write-backs and promotions between the tiers."""

    def __init__(
        self,
        local: MemoryTiers,
        cpu_rule: FillRule | None,
        lanes: Sequence[FillRule],
        metrics: Metrics,
        *,
        gpu_name: str,
        block_size: int,
        bytes_per_block: int,
        max_pending_stores: int,
        remember_keys: int,
        observer: TierObserver | None = None,
    ) -> None:
        self.local = local
        self.cpu_rule = cpu_rule
        self.lanes = list(lanes)
        self.metrics = metrics
        self.gpu_name = gpu_name
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.max_pending_stores = max_pending_stores
        self.pending_stores = 0
        self.observer: TierObserver = observer or NullObserver()
        self.outbox: list[Move] = []
        self._hits = HitCounts(remember_keys)
        self.written_keys = WrittenKeys(len(self.lanes), remember_keys)
        """Per lane, the keys known written there (``written_keys.landings`` is its clock)."""
        self._putting: list[dict[bytes, bool]] = [{} for _ in self.lanes]
        """Per lane, the keys with a put in flight, and whether the remote reported dropping them meanwhile."""

    @property
    def cpu_name(self) -> str:
        """The CPU tier's name (counters and events are kept under it)."""
        return self.cpu_rule.name if self.cpu_rule is not None else "cpu"

    # ---- admission ------------------------------------------------------------------
    def _admits(self, rule: FillRule, key: bytes, *, evicted: bool) -> bool:
        """Whether ``rule``'s tier takes ``key`` now (``evicted``: from an eviction above)."""
        return rule.admits(self._hits[key], evicted=evicted)

    def count_hits(
        self, keys: Sequence[bytes], tier_blocks: dict[str, int] | None = None, asked_blocks: int = 0
    ) -> None:
        """One hit per key for the request that loads them; a key reaching a threshold is admitted.

        ``tier_blocks`` (blocks served per tier) and ``asked_blocks`` (the prompt's
        full blocks) feed the hit counters.
        """
        for name, count in (tier_blocks or {}).items():
            self.metrics.add(name, "hit_blocks", count)
        self.metrics.add("all", "hit_blocks", len(keys))
        self.metrics.add("all", "lookup_blocks", asked_blocks)
        for key in keys:
            self._admit_on_hit(key, self._hits.hit(key))

    def _admit_on_hit(self, key: bytes, count: int) -> None:
        rule, gpu, cpu = self.cpu_rule, self.local.gpu, self.local.cpu
        if rule is not None and cpu is not None and key not in cpu and count == rule.admit_after_hits:
            block = gpu.readable(key) if gpu is not None else None
            if rule.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE and block is not None:
                self._copy_down([(key, block)], Reason.ADMITTED)
        slot = cpu.readable(key) if cpu is not None else None
        if slot is None:
            return
        for lane, lane_rule in enumerate(self.lanes):
            selective = lane_rule.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
            if selective and count == lane_rule.admit_after_hits and not self.written(lane, key):
                self.put(lane, [key], [slot], Reason.ADMITTED)

    # ---- the GPU pool -----------------------------------------------------------------
    def allocate(self, count: int, chain: Sequence[bytes] | None = None) -> list[int]:
        """``count`` held GPU blocks; victims are demoted to the CPU tier when it admits them.

        With the request's ``chain`` (its keys, prompt order) the pool's policy sees
        the request's incoming keys before it picks victims (``SlotTable.allocate_for``).
        """
        gpu = self.local.pool
        ids, victims = gpu.allocate(count) if chain is None else gpu.allocate_for(count, chain)
        if victims:
            self.metrics.add(self.gpu_name, "evictions", len(victims))
            self.observer.removed(self.gpu_name, [victim.key for victim in victims])
            self._demote([(victim.key, victim.slot) for victim in victims])
        return ids

    def _demote(self, victims: list[tuple[bytes, int]]) -> None:
        """GPU victims (in eviction order) go down to the CPU tier, each an access of its policy.

        A victim the CPU tier already holds (written through) is touched there, as a
        write-back's victim is inserted: the write policy decides when bytes move,
        not what the CPU tier's policy learns about use.
        """
        rule, cpu = self.cpu_rule, self.local.cpu
        if rule is None or cpu is None:
            return
        admitted, kept = [], []
        for key, block in victims:
            if key in cpu:
                if cpu.readable(key) is not None:
                    cpu.touch(key)
                    kept.append(key)
                continue
            if self._admits(rule, key, evicted=True):
                admitted.append((key, block))
            else:
                self.metrics.add(rule.name, "not_admitted")
        if kept:
            self.observer.accessed(rule.name, kept)
        self._copy_down(admitted, Reason.DEMOTION)

    def store(self, keys: Sequence[bytes], ids: Sequence[int], tokens: Sequence[int] | None = None) -> int:
        """Index a request's chain in its GPU blocks, reporting it to the policy tail first.

        Blocks promoted by this request's load were bound untracked; blocks the
        engine computed are bound now; blocks cached before are hits; blocks
        ``allocate`` admitted for this request were counted then. Returns the
        number of blocks newly indexed; raises ValueError for a block that holds
        another prefix's KV (nothing is changed then). ``tokens`` (the prompt)
        only feeds the observer's events.
        """
        gpu = self.local.pool
        for key, block in zip(keys, ids, strict=True):
            bound = gpu.key_of(block)
            if bound is not None and bound != key:
                raise ValueError(f"store: GPU block {block} already holds another prefix's KV")
        fresh: list[tuple[bytes, int]] = []  # tail first
        for key, block in reversed(list(zip(keys, ids, strict=True))):
            bound = gpu.key_of(block)
            if bound is None and key not in gpu:
                gpu.bind(block, key)
                fresh.append((key, block))
            elif bound is None:
                self.metrics.add(self.gpu_name, "duplicate_blocks")
                if gpu.readable(key) is not None:
                    gpu.touch(key)
            else:
                gpu.request(key)
        self.metrics.add(self.gpu_name, "stored_blocks", len(fresh))
        self.observer.accessed(self.gpu_name, keys)
        report_stored_runs(self.observer, self.gpu_name, keys, {key for key, _ in fresh}, tokens, self.block_size)
        rule = self.cpu_rule
        if rule is not None and fresh:
            admitted = [(key, block) for key, block in fresh if self._admits(rule, key, evicted=False)]
            self._copy_down(admitted, Reason.WRITE_THROUGH)
        return len(fresh)

    # ---- the CPU tier -----------------------------------------------------------------
    def _copy_down(self, pairs: list[tuple[bytes, int]], reason: Reason) -> None:
        """Begin CPU writes for (key, GPU block) pairs and queue their copy; no room is counted.

        The CPU tier's policy sees the writes in the order of ``pairs``: a chain's tail first.
        """
        cpu = self.local.cpu
        assert cpu is not None and self.cpu_rule is not None
        keys, blocks, slots = [], [], []
        for key, block in pairs:
            if key in cpu:
                continue
            slot = self.begin_cpu_write(key)
            if slot is None:
                self.metrics.add(self.cpu_rule.name, f"{reason.value}_dropped")
                continue
            keys.append(key)
            blocks.append(block)
            slots.append(slot)
        if not keys:
            return
        before_reuse = reason is Reason.DEMOTION
        if not before_reuse:
            for block in blocks:
                self.local.pool.pin(block)
        self.metrics.add(self.cpu_rule.name, f"{reason.value}_blocks", len(keys))
        self._count_move(self.gpu_name, self.cpu_rule.name, len(keys))
        self.outbox.append(HostCopy(tuple(keys), tuple(blocks), tuple(slots), reason, before_reuse))

    def begin_cpu_write(self, key: bytes) -> int | None:
        """A CPU slot being written for ``key`` (None when the tier has no room)."""
        cpu = self.local.cpu
        assert cpu is not None and self.cpu_rule is not None
        lanes_for: dict[bytes, list[int]] = {}

        def retain(victim: bytes) -> bool:
            lanes = self._write_back_lanes(victim)
            if lanes:
                lanes_for[victim] = lanes
            return bool(lanes)

        slot: int | None = None
        try:
            slot, victims = cpu.begin_write(key, retain)
        except CapacityError as full:
            victims = full.victims
        self.observer.accessed(self.cpu_rule.name, [key])
        self.metrics.add(self.cpu_rule.name, "evictions", len(victims))
        if victims:
            self.observer.removed(self.cpu_rule.name, [victim.key for victim in victims])
        for victim in victims:
            if not victim.retained:
                continue
            lanes = lanes_for[victim.key]
            for _ in lanes[1:]:
                cpu.pin(victim.slot)
            for lane in lanes:
                self.pending_stores += 1
                self._queue_put(RemotePut(lane, (victim.key,), (victim.slot,), Reason.DEMOTION))
        return slot

    def _write_back_lanes(self, key: bytes) -> list[int]:
        """The remote lanes a CPU victim must still be written to (drops counted when the queue is full)."""
        lanes = []
        for lane, rule in enumerate(self.lanes):
            if not self.owes(lane, key):
                continue
            if self.pending_stores + len(lanes) >= self.max_pending_stores:
                self.metrics.add(rule.name, "stores_dropped")
                continue
            lanes.append(lane)
        return lanes

    def owes(self, lane: int, key: bytes) -> bool:
        """Whether ``lane`` still needs ``key`` from the CPU tier: not known written there, admitted on eviction."""
        return not self.written(lane, key) and self._admits(self.lanes[lane], key, evicted=True)

    def end_cpu_writes(self, slots: Sequence[int], oks: Sequence[bool]) -> None:
        """CPU writes finished: committed slots become cached, failed ones are forgotten."""
        cpu = self.local.cpu
        assert cpu is not None
        committed = []
        for slot, ok in zip(slots, oks, strict=True):
            if ok:
                cpu.commit_write(slot)
                committed.append(cpu.key_of(slot))
            else:
                cpu.abort_write(slot)
        if committed and self.cpu_rule is not None:
            self.observer.stored(self.cpu_rule.name, committed, None, None)

    def copy_done(self, move: HostCopy, ok: bool) -> None:
        """A GPU->CPU copy landed (or failed): commit its slots and write through to remotes."""
        if not move.before_reuse:
            for block in move.gpu_ids:
                self.local.pool.unpin(block)
        self.written_down(move.keys, move.cpu_slots, [ok] * len(move.keys))

    def begin_engine_write(self, key: bytes) -> int | None:
        """A CPU slot for a block the engine copies in from its own pool (``LowerTiers``): None when the CPU
        tier holds it already, does not admit it yet, or has no room (counted)."""
        cpu, rule = self.local.cpu, self.cpu_rule
        assert cpu is not None and rule is not None
        if key in cpu:
            return None
        if not self._admits(rule, key, evicted=False):
            self.metrics.add(rule.name, "not_admitted")
            return None
        slot = self.begin_cpu_write(key)
        if slot is None:
            self.metrics.add(rule.name, f"{Reason.WRITE_THROUGH.value}_dropped")
        return slot

    def written_down(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        """Blocks copied into the CPU slots begun for them landed (or failed): commit them, write through."""
        self.end_cpu_writes(slots, oks)
        landed = [(key, slot) for key, slot, ok in zip(keys, slots, oks, strict=True) if ok]
        if not landed:
            return
        for lane in range(len(self.lanes)):
            self._write_through(lane, [key for key, _ in landed], [slot for _, slot in landed], Reason.WRITE_THROUGH)

    # ---- remote lanes -----------------------------------------------------------------
    def written(self, lane: int, key: bytes) -> bool:
        """Whether ``key`` is remembered as stored in ``lane``."""
        return self.written_keys.holds(lane, key)

    def put(self, lane: int, keys: list[bytes], slots: list[int], reason: Reason) -> None:
        """Queue a put of readable CPU slots (pinned until it lands), or drop it when the queue is full."""
        cpu = self.local.cpu
        assert cpu is not None
        if self.pending_stores + len(keys) > self.max_pending_stores:
            self.metrics.add(self.lanes[lane].name, "stores_dropped", len(keys))
            return
        for slot in slots:
            cpu.pin(slot)
        self.pending_stores += len(keys)
        self._queue_put(RemotePut(lane, tuple(keys), tuple(slots), reason))

    def _queue_put(self, move: RemotePut) -> None:
        """A put for the outbox; its keys are in flight to the lane until ``put_done``."""
        putting = self._putting[move.lane]
        for key in move.keys:
            putting[key] = False
        self.outbox.append(move)

    def put_done(self, move: RemotePut, oks: Sequence[bool]) -> None:
        """A put landed: unpin its slots (a write-back victim's slot frees), remember what was written; a key the
        remote reported dropping while its put was in flight is forgotten now."""
        cpu = self.local.cpu
        assert cpu is not None
        putting = self._putting[move.lane]
        dropped = [key for key in move.keys if putting.pop(key, False)]
        for slot in move.cpu_slots:
            cpu.unpin(slot)
        self.pending_stores -= len(move.keys)
        landed = [key for key, ok in zip(move.keys, oks, strict=True) if ok]
        self.written_keys.landed(move.lane, landed)
        name = self.lanes[move.lane].name
        self.observer.accessed(name, move.keys)
        self.observer.stored(name, landed, None, None)
        stored = len(landed)
        self._count_move(self.cpu_name, name, stored)
        self.metrics.add(name, "store_failures", len(move.keys) - stored)
        self.metrics.add(name, "bytes_written", stored * self.bytes_per_block)
        if dropped:
            self.forget(move.lane, dropped)

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
        """Blocks read from ``lane`` into CPU slots: known there; written into the faster remotes above it."""
        self.written_keys.landed(lane, keys)
        self.observer.stored(self.lanes[lane].name, keys, None, None)  # served: held, whatever was said before
        for faster in range(lane):
            self._write_through(faster, keys, slots, Reason.PROMOTION)

    def _write_through(self, lane: int, keys: Sequence[bytes], slots: Sequence[int], reason: Reason) -> None:
        """Put the CPU slots of the keys ``lane`` does not hold yet and admits now (not from an eviction)."""
        rule = self.lanes[lane]
        todo = [
            (key, slot)
            for key, slot in zip(keys, slots, strict=True)
            if not self.written(lane, key) and self._admits(rule, key, evicted=False)
        ]
        if todo:
            self.put(lane, [key for key, _ in todo], [slot for _, slot in todo], reason)

    def forget(self, lane: int, keys: Sequence[bytes], *, proven: bool = True) -> None:
        """The remote may have lost these keys: the next store writes them again.

        ``proven``: the remote said so (it answered "not held", or reported dropping
        them), and they are reported removed; else (a read failed) nothing is reported.
        """
        self.written_keys.forget(lane, keys)
        if proven:
            self.observer.removed(self.lanes[lane].name, keys)

    def forget_absent(self, lane: int, keys: Sequence[bytes], clock: int) -> None:
        """``lane`` answered, when ``written_keys.landings`` read ``clock``, that it does not hold ``keys``:
        forget them and report them removed, but for those seen there since (stored again meanwhile)."""
        self.forget(lane, [key for key in keys if not self.written_keys.landed_since(lane, key, clock)])

    def _count_move(self, source: str, destination: str, blocks: int) -> None:
        """Blocks copied from one tier to another (``blocks_out`` / ``blocks_in``)."""
        self.metrics.add(source, "blocks_out", blocks)
        self.metrics.add(destination, "blocks_in", blocks)
