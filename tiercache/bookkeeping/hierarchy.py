"""The local tiers' hierarchy: how the GPU pool and the CPU tier fill each other, by write policy, admission and
``exclusive``.

Pure: it changes slot tables and counters under the manager's lock and turns
"allocated", "stored", "landed" and "loaded" into moves
(``tiercache.bookkeeping.moves``) in the outbox; what the remotes below the CPU
tier are written is ``RemoteWrites``'s, which it tells of every block that
lands in, or is evicted from, the CPU tier. Rules:

* The CPU tier's write policy says how it is filled from the GPU pool:
  ``write_through`` on store, ``write_back`` on eviction only,
  ``write_through_selective`` once a block was hit ``admit_after_hits`` times,
  on store and on demotion alike (a demoted block below the threshold is
  dropped and counted as ``not_admitted``) (docs/architecture.md, "Hierarchy").
* A hit counts once per request, when the engine loads it (``count_hits``), never per lookup (``admission``;
  docs/architecture.md, "Eviction order and prefixes").
* A block a load promoted into the GPU pool leaves the CPU tier under ``exclusive`` (``promoted``).
* A CPU victim that a remote still needs keeps its slot, pinned, until its put lands
  (``RemoteWrites.write_back``; docs/architecture.md, "Entry state").

Each kind of caller comes in by a door of its own:

* the GPU pool tiercache manages (``TierManager``): ``allocate`` and ``store``,
  and the mover's report of their copies, ``copy_done``;
* an engine that keeps its own pool (``LowerTiers``): ``begin_engine_writes``
  and ``end_engine_writes`` for the blocks it copies into CPU slots itself;
* a read from a remote into the CPU tier (a load's, an exploration's):
  ``begin_remote_read`` and ``end_remote_reads``; a load then tells
  ``served_from_cpu`` and ``promoted``;
* an operator: ``reset_cpu_tier``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.bookkeeping.admission import FillRule, HitCounts, WritePolicy
from tiercache.bookkeeping.memory_tiers import MemoryTiers
from tiercache.bookkeeping.moves import HostCopy, Outbox, Reason
from tiercache.bookkeeping.remote_writes import RemoteWrites
from tiercache.bookkeeping.slots import CapacityError, SlotTable
from tiercache.telemetry.counters import Metrics
from tiercache.telemetry.observer import TierObserver, report_stored_runs


class Hierarchy:
    """Write policy, admission, demotions and promotions between the GPU pool and the CPU tier."""

    def __init__(
        self,
        local: MemoryTiers,
        cpu_rule: FillRule | None,
        remote_writes: RemoteWrites,
        hits: HitCounts,
        outbox: Outbox,
        metrics: Metrics,
        observer: TierObserver,
        *,
        gpu_name: str,
        block_size: int,
        exclusive: bool,
    ) -> None:
        """``cpu_rule``: the CPU tier's write policy (None: no CPU tier); ``hits``: the hit counts, shared with
        ``remote_writes``; ``gpu_name``: the GPU pool's name in counters and events (the engine's own, under
        ``LowerTiers``)."""
        self._local = local
        self._cpu_rule = cpu_rule
        self._remote_writes = remote_writes
        self._hits = hits
        self._outbox = outbox
        self._metrics = metrics
        self._observer = observer
        self._gpu_name = gpu_name
        self._block_size = block_size
        self._exclusive = exclusive

    @property
    def cpu_name(self) -> str:
        """The CPU tier's name (counters and events are kept under it)."""
        return self._cpu_rule.name if self._cpu_rule is not None else "cpu"

    @property
    def _cpu(self) -> SlotTable:
        if self._local.cpu is None or self._cpu_rule is None:
            raise RuntimeError("the topology has no CPU tier")
        return self._local.cpu

    # ---- hits ----------------------------------------------------------------------------
    def count_hits(
        self, keys: Sequence[bytes], tier_blocks: dict[str, int] | None = None, asked_blocks: int = 0
    ) -> None:
        """One hit per key for the request that loads them; a key reaching a threshold is admitted.

        ``tier_blocks`` (blocks served per tier) and ``asked_blocks`` (the prompt's
        full blocks) feed the hit counters.
        """
        counts = [(name, "hit_blocks", count) for name, count in (tier_blocks or {}).items()]
        self._metrics.add_each([*counts, ("all", "hit_blocks", len(keys)), ("all", "lookup_blocks", asked_blocks)])
        for key in keys:
            self._admit_on_hit(key, self._hits.hit(key))

    def _admit_on_hit(self, key: bytes, count: int) -> None:
        rule, gpu, cpu = self._cpu_rule, self._local.gpu, self._local.cpu
        if rule is not None and cpu is not None and key not in cpu and count == rule.admit_after_hits:
            block = gpu.readable(key) if gpu is not None else None
            if rule.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE and block is not None:
                self._copy_down([(key, block)], Reason.ADMITTED)
        slot = cpu.readable(key) if cpu is not None else None
        if slot is not None:
            self._remote_writes.admit_on_hit(key, slot, count)

    def _admits(self, key: bytes, *, evicted: bool) -> bool:
        """Whether the CPU tier takes ``key`` now (``evicted``: from an eviction above)."""
        return self._cpu_rule is not None and self._cpu_rule.admits(self._hits[key], evicted=evicted)

    # ---- the GPU pool tiercache manages (TierManager) -----------------------------------------
    def allocate(self, count: int, chain: Sequence[bytes] | None = None) -> list[int]:
        """``count`` held GPU blocks; victims are demoted to the CPU tier when it admits them.

        With the request's ``chain`` (its keys, prompt order) the pool's policy sees
        the request's incoming keys before it picks victims (``SlotTable.allocate_for``).
        """
        gpu = self._local.pool
        ids, victims = gpu.allocate(count) if chain is None else gpu.allocate_for(count, chain)
        if victims:
            self._metrics.add(self._gpu_name, "evictions", len(victims))
            self._observer.removed(self._gpu_name, [victim.key for victim in victims])
            self._demote([(victim.key, victim.slot) for victim in victims])
        return ids

    def _demote(self, victims: list[tuple[bytes, int]]) -> None:
        """GPU victims (in eviction order) go down to the CPU tier, each an access of its policy.

        A victim the CPU tier already holds (written through) is touched there, as a
        write-back's victim is inserted: the write policy decides when bytes move,
        not what the CPU tier's policy learns about use.
        """
        cpu = self._local.cpu
        if cpu is None:
            return
        admitted, kept = [], []
        for key, block in victims:
            if key in cpu:
                if cpu.readable(key) is not None:
                    cpu.touch(key)
                    kept.append(key)
                continue
            if self._admits(key, evicted=True):
                admitted.append((key, block))
            else:
                self._metrics.add(self.cpu_name, "not_admitted")
        if kept:
            self._observer.accessed(self.cpu_name, kept)
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
        gpu = self._local.pool
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
                self._metrics.add(self._gpu_name, "duplicate_blocks")
                if gpu.readable(key) is not None:
                    gpu.touch(key)
            else:
                gpu.request(key)
        self._metrics.add(self._gpu_name, "stored_blocks", len(fresh))
        self._observer.accessed(self._gpu_name, keys)
        report_stored_runs(self._observer, self._gpu_name, keys, {key for key, _ in fresh}, tokens, self._block_size)
        if self._cpu_rule is not None and fresh:
            self._copy_down([(key, block) for key, block in fresh if self._admits(key, evicted=False)],
                            Reason.WRITE_THROUGH)
        return len(fresh)

    def _copy_down(self, pairs: list[tuple[bytes, int]], reason: Reason) -> None:
        """Begin CPU writes for (key, GPU block) pairs and queue their copy; no room is counted.

        The CPU tier's policy sees the writes in the order of ``pairs``: a chain's tail first.
        """
        cpu = self._cpu
        keys, blocks, slots = [], [], []
        for key, block in pairs:
            if key in cpu:
                continue
            slot = self._begin_cpu_write(key)
            if slot is None:
                self._metrics.add(self.cpu_name, f"{reason.value}_dropped")
                continue
            keys.append(key)
            blocks.append(block)
            slots.append(slot)
        if not keys:
            return
        before_reuse = reason is Reason.DEMOTION
        if not before_reuse:
            for block in blocks:
                self._local.pool.pin(block)
        self._metrics.add(self.cpu_name, f"{reason.value}_blocks", len(keys))
        self._metrics.add(self._gpu_name, "blocks_out", len(keys))
        self._metrics.add(self.cpu_name, "blocks_in", len(keys))
        self._outbox.add(HostCopy(tuple(keys), tuple(blocks), tuple(slots), reason, before_reuse))

    def copy_done(self, move: HostCopy, ok: bool) -> None:
        """A GPU->CPU copy landed (or failed): commit its slots and write them down to the remotes."""
        if not move.before_reuse:
            for block in move.gpu_ids:
                self._local.pool.unpin(block)
        self._landed(move.keys, move.cpu_slots, [ok] * len(move.keys))

    # ---- an engine that keeps its own pool (LowerTiers) --------------------------------------
    def begin_engine_writes(self, keys: Sequence[bytes]) -> list[int | None]:
        """CPU slots for blocks the engine copies in from its own pool: None where the CPU tier holds the block
        already, does not admit it yet, or has no room (counted)."""
        cpu = self._cpu
        return [None if key in cpu else self._begin_engine_write(key) for key in keys]

    def _begin_engine_write(self, key: bytes) -> int | None:
        if not self._admits(key, evicted=False):
            self._metrics.add(self.cpu_name, "not_admitted")
            return None
        slot = self._begin_cpu_write(key)
        if slot is None:
            self._metrics.add(self.cpu_name, f"{Reason.WRITE_THROUGH.value}_dropped")
        return slot

    def end_engine_writes(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        """The engine's copies into the slots ``begin_engine_writes`` gave landed (``oks``): commit them and write
        them down to the remotes."""
        self._landed(keys, slots, oks)
        self._metrics.add(self.cpu_name, "blocks_in", sum(oks))

    # ---- reads from a remote into the CPU tier (loads, explorations) -----------------------------
    def begin_remote_read(self, key: bytes) -> int | None:
        """A CPU slot being written for ``key``, which a read from a remote fills (None when the tier has no
        room); ``end_remote_reads`` ends it, and ``RemoteWrites.fetched`` says where it came from."""
        return self._begin_cpu_write(key)

    def end_remote_reads(self, slots: Sequence[int], oks: Sequence[bool]) -> None:
        """Reads into ``slots`` ended: the filled ones become cached, the others are forgotten."""
        self._end_cpu_writes(slots, oks)

    def served_from_cpu(self, keys: Sequence[bytes]) -> None:
        """A load takes ``keys`` from the CPU tier: one access each for its policy, tail first."""
        self._local.touch_tail_first(self._cpu, keys)
        self._observer.accessed(self.cpu_name, keys)

    def promoted(self, blocks: Sequence[tuple[bytes, int | None]], copied_on_gpu: int) -> None:
        """A load handed its blocks over: ``blocks`` (key, GPU block; None where the engine copies out of the CPU
        slot itself) came up from the CPU tier and are indexed in the pool (untracked: the request reports its
        chain at ``store``), and leave the CPU tier under ``exclusive``; ``copied_on_gpu`` more were copied on
        the device."""
        promoted, freed = [], []
        for key, block in blocks:
            if block is None:
                continue
            gpu = self._local.pool
            if key not in gpu:
                gpu.bind(block, key, track=False)
                promoted.append(key)
            if self._exclusive and self._cpu.discard(key):
                freed.append(key)
        self._metrics.add_each(
            [(self.cpu_name, "blocks_out", len(blocks)), (self._gpu_name, "blocks_in", len(blocks) + copied_on_gpu)]
        )
        self._observer.stored(self._gpu_name, promoted, None, None)
        self._observer.removed(self.cpu_name, freed)

    # ---- an operator ---------------------------------------------------------------------------
    def reset_cpu_tier(self) -> list[bytes]:
        """Drop the CPU tier's entries nothing holds, freeing their slots; the keys dropped, in slot order.

        An entry stays, readable in its slot, while anything holds it: a pin (a
        lookup's, a fetch's, a put in flight), a write into it, or a remote that
        still needs it written (``RemoteWrites.owes``: dropping it would need a
        write-back that a full store queue drops). Each entry dropped is counted and
        reported as an eviction is; the remotes, the hit counts and what each remote
        was told to hold are left as they are.
        """
        cpu = self._cpu
        dropped = []
        for slot in range(cpu.num_slots):
            key = cpu.key_of(slot)
            if key is None or cpu.ref(slot) != 0 or self._remote_writes.owes(key):
                continue
            cpu.discard(key)
            dropped.append(key)
        self._metrics.add(self.cpu_name, "evictions", len(dropped))
        if dropped:
            self._observer.removed(self.cpu_name, dropped)
        return dropped

    # ---- CPU writes ------------------------------------------------------------------------------
    def _begin_cpu_write(self, key: bytes) -> int | None:
        """A CPU slot being written for ``key`` (None when the tier has no room); victims a remote still needs
        are kept for their write-backs."""
        cpu = self._cpu
        lanes_for: dict[bytes, list[int]] = {}

        def retain(victim: bytes) -> bool:
            lanes = self._remote_writes.write_back_lanes(victim)
            if lanes:
                lanes_for[victim] = lanes
            return bool(lanes)

        slot: int | None = None
        try:
            slot, victims = cpu.begin_write(key, retain)
        except CapacityError as full:
            victims = full.victims
        self._observer.accessed(self.cpu_name, [key])
        self._metrics.add(self.cpu_name, "evictions", len(victims))
        if victims:
            self._observer.removed(self.cpu_name, [victim.key for victim in victims])
        for victim in victims:
            if victim.retained:
                self._remote_writes.write_back(victim.key, victim.slot, lanes_for[victim.key])
        return slot

    def _end_cpu_writes(self, slots: Sequence[int], oks: Sequence[bool]) -> None:
        """CPU writes finished: committed slots become cached, failed ones are forgotten."""
        cpu = self._cpu
        committed = []
        for slot, ok in zip(slots, oks, strict=True):
            if ok:
                cpu.commit_write(slot)
                committed.append(cpu.key_of(slot))
            else:
                cpu.abort_write(slot)
        if committed:
            self._observer.stored(self.cpu_name, committed, None, None)

    def _landed(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        """Blocks copied into the CPU slots begun for them landed (or failed): commit them, write them through."""
        self._end_cpu_writes(slots, oks)
        landed = [(key, slot) for key, slot, ok in zip(keys, slots, oks, strict=True) if ok]
        if landed:
            self._remote_writes.write_through([key for key, _ in landed], [slot for _, slot in landed])
