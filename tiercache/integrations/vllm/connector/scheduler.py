"""The scheduler side: tiercache's bookkeeping and remote I/O in vLLM's engine-core process, never blocking it.

Where the state lives: the CPU tier's bookkeeping, its policy, the remotes with
their lanes, presence cache, cost model and events are a ``LowerTiers``
(docs/architecture.md, "The contract with the engine") here, in the scheduler's
process; the CPU tier's memory is a shared region the workers map (``region``);
the workers only copy pages between vLLM's blocks and its slots, as each step's
metadata says (``worker``). Per request:

* ``get_num_new_matched_tokens`` looks the prompt's chained keys up beyond
  vLLM's own prefix-cache hit. CPU-resident blocks are pinned at once; blocks
  only a remote holds are read into CPU slots in the background while vLLM is
  told to ask again (``None``), as long as the topology's prefetch policy lets
  a request wait (``QueueConfig.prefetch_wait_s``: ``wait_complete`` until they
  arrived or failed, ``timeout`` its deadline, ``best_effort`` not at all). The
  answer is a sync load of whole blocks that leaves at least one prompt token to
  compute, so a load failure is recomputed, and the request is never parked
  waiting for a worker;
* ``update_state_after_alloc`` pairs the pinned slots with vLLM's blocks, and the
  next ``build_connector_meta`` sends them as a load job;
* every step, blocks that became full (prompt and output) get CPU slots and a
  store job; a store is committed and written down to the remotes once every
  worker copied it (``update_connector_output``), a load's pins go then too.

Nothing raises into vLLM: a failure is logged and answered as a miss.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tiercache.integrations.vllm.connector.events import stored_events
from tiercache.integrations.vllm.connector.identity import block_extra
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.stats import TIER_SEPARATOR, SchedulerCounters
from tiercache.manager.lower_tiers import HostFetch, LowerTiers

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    """What the scheduler side keeps of one vLLM request."""

    request: Any
    extra: str | None
    keys: list[bytes] = field(default_factory=list)
    """The chained keys of its full blocks so far (extended as tokens are computed)."""
    fetch: HostFetch | None = None
    asked_at: float = 0.0
    skip: int = 0
    """vLLM's own prefix-cache hit, in blocks, when the connector was asked."""
    offer: list[int] = field(default_factory=list)
    """The CPU slots offered to vLLM as external tokens."""
    tiers: list[str] = field(default_factory=list)
    """Per block of the fetch, the tiercache tier serving it."""
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    stored: int = 0
    """Blocks below this index have a store planned (or are held already)."""


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

    def __init__(self, tiers: LowerTiers, world: int, force_latest: bool, *, events: bool = False) -> None:
        self.tiers = tiers
        self.events: list[Any] | None = [] if events else None
        """vLLM KV events of what the CPU tier took (None: vLLM's KV events are off)."""
        self.world = world
        self.force_latest = force_latest
        self.block_size = tiers.block_size
        self.queues = tiers.config.queues
        self.requests: dict[str, _Request] = {}
        self._pending: dict[int, _Pending] = {}
        self._loads: list[tuple[str, CopyJob]] = []
        self._job_ids = itertools.count()
        self.counters = SchedulerCounters()

    # ---- admission -----------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that tiercache can load now (None: ask again); never a wait."""
        state = self._state(request)
        usable = (request.num_tokens - 1) // self.block_size  # a sync load leaves a token to compute
        skip = num_computed_tokens // self.block_size
        if state.fetch is not None and skip != state.skip:  # vLLM's own hit moved: the fetch no longer lines up
            state.fetch.release()
            state.fetch = None
        state.skip = skip
        if usable <= skip:
            return 0, False
        if state.fetch is None:
            keys = self._keys(state, usable * self.block_size)[state.skip : usable]
            hit = self.tiers.lookup(keys, local_only=not keys)
            if hit is None:
                self.counters.add("lookups_pending")
                return None, False
            self.counters.add("lookups")
            if not hit.num_blocks:
                self.tiers.release(hit)
                return 0, False
            state.fetch = self.tiers.fetch(hit, force_latest=self.force_latest)
            state.tiers, state.asked_at = list(hit.tiers), time.monotonic()
        fetch = state.fetch
        if not fetch.ready() and self._may_wait(state, len(fetch.items)):
            return None, False
        slots = fetch.slots()
        state.offer = slots[: usable - state.skip]
        self.counters.add("offered_blocks", len(state.offer))
        return len(state.offer) * self.block_size, False

    def track(self, request: Any) -> None:
        """Keep a request tiercache does not load for (a kv_producer's): its blocks are still stored."""
        self._state(request)

    def _may_wait(self, state: _Request, blocks: int) -> bool:
        """Whether a request may still be held back for its remote blocks (the topology's prefetch policy)."""
        return time.monotonic() - state.asked_at < self.queues.prefetch_wait_s(blocks * self.block_size)

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: pair the offered slots with the blocks that take them."""
        state = self.requests.get(request.request_id)
        if state is None or state.fetch is None:
            return
        count = num_external_tokens // self.block_size
        if count:
            job = CopyJob(next(self._job_ids), tuple(state.offer[:count]),
                          tuple(block_ids[state.skip : state.skip + count]))
            self._pending[job.job_id] = _Pending(fetch=state.fetch)
            self._loads.append((request.request_id, job))
            self.counters.add("loaded_blocks", count)
            for tier in state.tiers[:count]:
                self.counters.add(f"hit_blocks{TIER_SEPARATOR}{tier}")
        else:
            state.fetch.release()
        state.fetch, state.offer = None, []

    # ---- each step -----------------------------------------------------------------------
    def step_metadata(self, output: Any, *, store: bool = True) -> TierCacheConnectorMetadata:
        """This step's jobs: the loads admitted, and (``store``: not a kv_consumer) stores of the blocks this step
        fills."""
        metadata = TierCacheConnectorMetadata(loads=[job for _, job in self._loads])
        self._loads = []
        for new in output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.block_ids, state.computed = list(new.block_ids[0]), new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for position, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            blocks = cached.new_block_ids[position]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(blocks[0]) if blocks else []
            elif blocks:
                state.block_ids.extend(blocks[0])
            state.computed = cached.num_computed_tokens[position]
        for req_id, scheduled in output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is not None and store:
                job = self._store_job(state, state.computed + scheduled)
                if job is not None:
                    metadata.stores.append(job)
        return metadata

    def _store_job(self, state: _Request, computed: int) -> CopyJob | None:
        """Slots for the blocks that are full once ``computed`` tokens have their KV (None: none to store)."""
        full = min(computed, len(state.request.all_token_ids), len(state.block_ids) * self.block_size)
        end = full // self.block_size
        if end <= state.stored:
            return None
        keys = self._keys(state, end * self.block_size)[state.stored : end]
        blocks = state.block_ids[state.stored : end]
        state.stored = end
        slots = self.tiers.begin_writes(keys)
        first = end - len(keys)
        chosen = [
            (key, slot, block, first + i)
            for i, (key, slot, block) in enumerate(zip(keys, slots, blocks, strict=True))
            if slot is not None
        ]
        if not chosen:
            return None
        job = CopyJob(next(self._job_ids), tuple(c[1] for c in chosen), tuple(c[2] for c in chosen))
        self._pending[job.job_id] = _Pending(
            keys=[c[0] for c in chosen], slots=list(job.slots), request=state.request, positions=[c[3] for c in chosen]
        )
        self.counters.add("stored_blocks", len(chosen))
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
        if state is not None and state.fetch is not None:
            state.fetch.release()

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

    def _keys(self, state: _Request, tokens: int) -> list[bytes]:
        """The keys of the request's full blocks within its first ``tokens`` tokens (extended as needed)."""
        blocks = tokens // self.block_size
        if len(state.keys) < blocks:
            start = len(state.keys) * self.block_size
            new = state.request.all_token_ids[start : blocks * self.block_size]
            parent = state.keys[-1] if state.keys else None
            state.keys.extend(self.tiers.hasher.keys(new, state.extra, parent=parent))
        return state.keys[:blocks]
