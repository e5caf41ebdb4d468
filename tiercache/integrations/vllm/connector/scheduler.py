"""The scheduler side: tiercache's bookkeeping and remote I/O in vLLM's engine-core process, never blocking it.

Where the state lives: the CPU tier's bookkeeping, its policy, the remotes with
their lanes, presence cache, cost model and events are a ``LowerTiers``
(docs/architecture.md, "The contract with the engine") here, in the scheduler's
process; the CPU tier's memory is a shared region the workers map (``region``);
the workers only copy pages between vLLM's blocks and its slots, as each step's
metadata says (``worker``). Per request:

* ``get_num_new_matched_tokens`` looks the prompt's chained keys up beyond
  vLLM's own prefix-cache hit, per KV-cache group (``groups``: every block of a
  full-attention group, a sliding group's window before the end; the longest
  end held whole, tried end by end). CPU-resident blocks are pinned at once; blocks
  only a remote holds are read into CPU slots in the background while vLLM is
  told to ask again (``None``), as long as the topology's prefetch policy lets
  a request wait (``QueueConfig.prefetch_wait_s``: ``wait_complete`` until they
  arrived or failed, ``timeout`` its deadline, ``best_effort`` not at all). The
  answer is a sync load of whole blocks that leaves at least one prompt token to
  compute, so a load failure is recomputed, and the request is never parked
  waiting for a worker;
* ``update_state_after_alloc`` pairs the pinned slots with vLLM's blocks of each
  group (never its null block), and the next ``build_connector_meta`` sends them
  as a load job;
* every step, blocks that became full (prompt and output) and that their group
  keeps (a sliding group: the windows a later request can hit) get CPU slots and a
  store job; a store is committed and written down to the remotes once every
  worker copied it (``update_connector_output``), a load's pins go then too.

Nothing raises into vLLM: a failure is logged and answered as a miss.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercache.integrations.vllm.connector.events import stored_events
from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.groups import (
    NULL_BLOCK,
    Entry,
    group_key,
    hit_entries,
    kept_positions,
    next_end,
    paired,
    tokens_by_tier,
)
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.metrics import TIER_SEPARATOR, SchedulerCounters
from tiercache.integrations.vllm.connector.namespace import block_extra
from tiercache.manager.lower_tiers import HostFetch, LowerTiers

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    """What the scheduler side keeps of one vLLM request."""

    request: Any
    extra: str | None
    keys: list[bytes] = field(default_factory=list)
    """The chained keys of its full blocks so far (extended as tokens are computed); a group's are derived."""
    fetch: HostFetch | None = None
    asked_at: float = 0.0
    skip: int = 0
    """vLLM's own prefix-cache hit, in blocks, when the connector was asked."""
    end: int = 0
    """The hit's end being looked up or fetched, in blocks (0: not chosen yet)."""
    tries: int = 0
    """Ends looked up and found not whole (``groups.next_end``)."""
    entries: list[Entry] = field(default_factory=list)
    """The (group, position) of each block of the fetch."""
    offer: list[int] = field(default_factory=list)
    """The CPU slots offered to vLLM as external tokens (one per entry)."""
    offered: int = 0
    """The blocks offered to vLLM as external tokens."""
    tiers: list[str] = field(default_factory=list)
    """Per block of the fetch, the tiercache tier serving it."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV-cache group, vLLM's block ids by position."""
    computed: int = 0
    stored: list[int] = field(default_factory=list)
    """Per group, positions below this have a store planned (or are held already)."""
    group_keys: dict[int, list[bytes]] = field(default_factory=dict)
    """Per group of a model of several, its blocks' keys so far (derived once, whatever the lookups tried)."""
    hit_tokens: dict[int, int] = field(default_factory=dict)
    """The last load's tokens by tier index (a position counts under the farthest tier any of its blocks came
    from), for vLLM's ``get_external_cache_hit_sources``."""


@dataclass(eq=False)
class _Pending:
    """A job sent to the workers, until every one of them reported it."""

    fetch: HostFetch | None = None
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    request: Any = None
    positions: list[int] = field(default_factory=list)
    """A store's block positions in its request (for KV events)."""
    reports: int = 0
    failed: bool = False


class ConnectorScheduler:
    """The scheduler's half of the connector (see the module docstring)."""

    def __init__(self, tiers: LowerTiers, geometry: SlotGeometry, force_latest: bool, *, events: bool = False) -> None:
        self.tiers = tiers
        self.geometry = geometry
        self.events: list[Any] | None = [] if events else None
        """vLLM KV events of what the CPU tier took (None: vLLM's KV events are off)."""
        self.world = geometry.world
        self.force_latest = force_latest
        self.block_size = tiers.block_size
        self.queues = tiers.config.queues
        self.requests: dict[str, _Request] = {}
        self._pending: dict[int, _Pending] = {}
        self._loads: list[tuple[str, CopyJob]] = []
        self._job_ids = itertools.count()
        self._event_group = next((i for i, g in enumerate(geometry.groups) if g.kind is GroupKind.FULL), None)
        """The group whose stores are reported as KV events (the first full-attention one; none: no events)."""
        self.counters = SchedulerCounters()

    # ---- admission -----------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that tiercache can load now (None: ask again); never a wait."""
        state = self._state(request)
        usable = (request.num_tokens - 1) // self.block_size  # a sync load leaves a token to compute
        skip = num_computed_tokens // self.block_size
        if skip != state.skip:  # vLLM's own hit moved: a lookup or fetch no longer lines up
            self._drop_fetch(state)
            state.end = state.tries = 0
        state.skip = skip
        if usable <= skip:
            return 0, False
        if state.fetch is None:
            found = self._find(state, min(state.end or usable, usable))
            if found is None:
                self.counters.add("lookups_pending")
                return None, False
            self.counters.add("lookups")
            if not found:
                return 0, False
        fetch = state.fetch
        assert fetch is not None
        if not fetch.ready() and self._may_wait(state, len(fetch.items)):
            return None, False
        slots = fetch.slots()
        groups = len(self.geometry.groups)
        if len(slots) == len(state.entries):
            state.offered = state.end - skip
        else:  # a prefix of whole positions, where no window is needed (else no block of this hit is any use)
            state.offered = 0 if self.geometry.hybrid else len(slots) // groups
        state.offer = slots if state.offered == state.end - skip else slots[: state.offered * groups]
        self.counters.add("offered_blocks", state.offered)
        return state.offered * self.block_size, False

    def _find(self, state: _Request, end: int) -> bool | None:
        """Look up ends from ``end`` down until one is held whole (a fetch starts) or none is left (False); None
        while a remote's answer is in flight (``state.end`` says where to go on)."""
        geometry = self.geometry
        while True:
            state.end = end
            entries = hit_entries(geometry, state.skip, end)
            keys = {group: self._group_keys(state, group, end) for group in range(len(geometry.groups))}
            hit = self.tiers.lookup([keys[group][position] for group, position in entries], local_only=not entries)
            if hit is None:
                return None
            if hit.num_blocks == len(entries) or (hit.num_blocks and not geometry.hybrid):
                break
            self.tiers.release(hit)
            state.tries += 1
            following = next_end(geometry, state.skip, entries[hit.num_blocks][1], state.tries)
            if following is None:
                state.end = state.tries = 0
                return False
            end = following
        if not geometry.hybrid:  # a prefix of whole positions is a hit too
            positions = hit.num_blocks // len(geometry.groups)
            if not positions:
                self.tiers.release(hit)
                state.end = 0
                return False
            state.end, entries = state.skip + positions, entries[: positions * len(geometry.groups)]
        state.entries = entries
        state.fetch = self.tiers.fetch(hit, len(entries), force_latest=self.force_latest)
        state.tiers, state.asked_at = list(hit.tiers[: len(entries)]), time.monotonic()
        return True

    def track(self, request: Any) -> None:
        """Keep a request tiercache does not load for (a kv_producer's): its blocks are still stored."""
        self._state(request)

    def _may_wait(self, state: _Request, blocks: int) -> bool:
        """Whether a request may still be held back for its remote blocks (the topology's prefetch policy)."""
        return time.monotonic() - state.asked_at < self.queues.prefetch_wait_s(blocks * self.block_size)

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (per group): pair the offered slots with the blocks that take them."""
        state = self.requests.get(request.request_id)
        if state is None or state.fetch is None:
            return
        count = num_external_tokens // self.block_size
        if count:
            end = state.skip + count
            pairs = paired(state.entries, state.offer, block_ids, end)
            invalid: tuple[int, ...] = ()
            if count != state.offered and self.geometry.hybrid:  # a window of another end: recomputed, never served
                pairs = [pair for pair in pairs if self.geometry.groups[pair[1]].kind is GroupKind.FULL]
                invalid = tuple(
                    block for group, blocks in enumerate(block_ids) for block in blocks[state.skip : end]
                    if block != NULL_BLOCK and self.geometry.groups[group].kind is GroupKind.SLIDING
                )
            job = CopyJob(next(self._job_ids), tuple(p[0] for p in pairs), tuple(p[2] for p in pairs),
                          tuple(p[1] for p in pairs), invalid)
            self._pending[job.job_id] = _Pending(fetch=state.fetch)
            self._loads.append((request.request_id, job))
            self.counters.add("loaded_blocks", len(pairs))
            self.counters.add("loaded_bytes", self._bytes(job.groups))
            for tier in state.tiers[: len(state.entries)]:
                self.counters.add(f"hit_blocks{TIER_SEPARATOR}{tier}")
            state.hit_tokens = tokens_by_tier(state.entries, state.tiers, self.tiers.names, end, self.block_size)
        else:
            state.fetch.release()
        state.fetch, state.offer, state.offered, state.end, state.tries = None, [], 0, 0, 0

    def hit_tokens(self, req_id: str) -> dict[int, int]:
        """The tokens of ``req_id``'s last load by tier index (once: vLLM asks right after allocating)."""
        state = self.requests.get(req_id)
        if state is None:
            return {}
        tokens, state.hit_tokens = state.hit_tokens, {}
        return tokens

    def has_pending(self) -> bool:
        """Whether jobs sent to the workers are not yet reported by every one of them."""
        return bool(self._pending)

    def _drop_fetch(self, state: _Request) -> None:
        if state.fetch is not None:
            state.fetch.release()
            state.fetch = None

    def _bytes(self, groups: Iterable[int]) -> int:
        """The bytes a job copies between vLLM's blocks and the CPU tier (every rank's pages of its blocks)."""
        return sum(self.geometry.group_bytes(group) for group in groups)

    # ---- each step -----------------------------------------------------------------------
    def step_metadata(self, output: Any, *, store: bool = True) -> TierCacheConnectorMetadata:
        """This step's jobs: the loads admitted, and (``store``: not a kv_consumer) stores of the blocks this step
        fills."""
        metadata = TierCacheConnectorMetadata(loads=[job for _, job in self._loads])
        self._loads = []
        for new in output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.block_ids, state.computed = [list(blocks) for blocks in new.block_ids], new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for position, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            blocks = cached.new_block_ids[position]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(group) for group in blocks] if blocks else []
            elif blocks:
                for group, new_ids in enumerate(blocks):
                    state.block_ids[group].extend(new_ids)
            state.computed = cached.num_computed_tokens[position]
        for req_id, scheduled in output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is not None and store and state.block_ids:
                job = self._store_job(state, state.computed + scheduled)
                if job is not None:
                    metadata.stores.append(job)
        return metadata

    def _store_job(self, state: _Request, computed: int) -> CopyJob | None:
        """Slots for the blocks each group keeps that are full once ``computed`` tokens have their KV (None: none
        to store)."""
        full = min(computed, len(state.request.all_token_ids)) // self.block_size
        if not state.stored:
            state.stored = [0] * len(self.geometry.groups)
        prompt_blocks = state.request.num_prompt_tokens // self.block_size
        wanted: list[tuple[bytes, int, int, int]] = []
        for group, blocks in enumerate(state.block_ids):
            end = min(full, len(blocks))
            keys = self._group_keys(state, group, end)
            for position in kept_positions(self.geometry, group, state.stored[group], end, prompt_blocks):
                if blocks[position] != NULL_BLOCK:
                    wanted.append((keys[position], group, blocks[position], position))
            state.stored[group] = max(state.stored[group], end)
        if not wanted:
            return None
        slots = self.tiers.begin_writes([w[0] for w in wanted])
        chosen = [(*w, slot) for w, slot in zip(wanted, slots, strict=True) if slot is not None]
        if not chosen:
            return None
        job = CopyJob(next(self._job_ids), tuple(c[4] for c in chosen), tuple(c[2] for c in chosen),
                      tuple(c[1] for c in chosen))
        self._pending[job.job_id] = _Pending(
            keys=[c[0] for c in chosen], slots=list(job.slots), request=state.request,
            positions=[c[3] for c in chosen if c[1] == self._event_group],
        )
        self.counters.add("stored_blocks", len(chosen))
        self.counters.add("stored_bytes", self._bytes(job.groups))
        return job

    def workers_reported(self, report: TierCacheWorkerMetadata | None) -> None:
        """Act on the jobs every worker has finished (or one has failed)."""
        if report is None:
            return
        for counts, failed in ((report.done, False), (report.failed, True)):
            for job_id, count in counts.items():
                pending = self._pending.get(job_id)
                if pending is None:
                    continue
                pending.reports += count
                pending.failed |= failed
                if pending.reports >= self.world:
                    self._finish(self._pending.pop(job_id))

    def _finish(self, pending: _Pending) -> None:
        if pending.fetch is not None:
            pending.fetch.release()
            if pending.failed:
                self.counters.add("failed_loads")
        else:
            ok = not pending.failed
            self.tiers.end_writes(pending.keys, pending.slots, [ok] * len(pending.keys))
            if not ok:
                self.counters.add("failed_stores")
            elif self.events is not None:
                tier = self.tiers.names[0]
                self.events.extend(stored_events(pending.request, pending.positions, self.block_size, tier))

    def take_events(self) -> list[Any]:
        """The KV events since the last call."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def finished(self, request: Any) -> None:
        """A request finished or was aborted: what only it held goes (jobs in flight finish on their own)."""
        state = self.requests.pop(request.request_id, None)
        if state is not None:
            self._drop_fetch(state)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Preempted requests lose their blocks; when resumed, vLLM asks again (what was stored stays)."""
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.block_ids, state.computed = [], 0

    def close(self) -> None:
        for state in self.requests.values():
            if state.fetch is not None:
                state.fetch.release()
        self.requests.clear()
        for pending in self._pending.values():
            if pending.fetch is not None:
                pending.fetch.release()
        self._pending.clear()
        self.tiers.close()

    # ---- keys ----------------------------------------------------------------------------
    def _state(self, request: Any) -> _Request:
        state = self.requests.get(request.request_id)
        if state is None:
            lora = getattr(request, "lora_request", None)
            extra = block_extra(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None))
            state = self.requests[request.request_id] = _Request(request, extra)
        return state

    def _group_keys(self, state: _Request, group: int, blocks: int) -> list[bytes]:
        """The keys of ``group``'s first ``blocks`` blocks of the request (the chained keys for a one-group model)."""
        keys = self._keys(state, blocks * self.block_size)
        if len(self.geometry.groups) == 1:
            return keys
        derived = state.group_keys.setdefault(group, [])
        derived.extend(group_key(key, group, self.geometry) for key in keys[len(derived) :])
        return derived[:blocks]

    def _keys(self, state: _Request, tokens: int) -> list[bytes]:
        """The keys of the request's full blocks within its first ``tokens`` tokens (extended as needed)."""
        blocks = tokens // self.block_size
        if len(state.keys) < blocks:
            start = len(state.keys) * self.block_size
            new = state.request.all_token_ids[start : blocks * self.block_size]
            parent = state.keys[-1] if state.keys else None
            state.keys.extend(self.tiers.hasher.keys(new, state.extra, parent=parent))
        return state.keys[:blocks]
