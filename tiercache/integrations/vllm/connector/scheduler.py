"""The scheduler side: tiercache's bookkeeping and remote I/O in vLLM's engine-core process, never blocking it.

Where the state lives: the CPU tier's bookkeeping, its policy, the remotes with
their lanes, presence cache, cost model and events are a ``LowerTiers``
(docs/architecture.md, "The contract with the engine") here, in the scheduler's
process; the CPU tier's memory is a shared region the workers map (``region``);
the workers only copy pages between vLLM's blocks and its slots, as each step's
metadata says (``worker``). Per request:

* ``get_num_new_matched_tokens``: its hit beyond vLLM's own prefix-cache hit is
  looked up, fetched into CPU slots and offered (``admission``), a synchronous or
  an asynchronous load of whole blocks that leaves at least one prompt token to
  compute;
* ``update_state_after_alloc`` pairs the pinned slots with vLLM's blocks of each
  group (never its null block), and the next ``build_connector_meta`` sends them
  as a load job;
* every step, blocks that became full (prompt and output) and that their group
  keeps (a sliding group: the windows a later request can hit) get CPU slots and a
  store job, within what a step may stage on the device (``step_budget``: a
  full-attention block past it is stored at a later step); a store is committed
  and written down to the remotes once every worker copied it
  (``update_connector_output``), a load's pins go then too.

Nothing raises into vLLM: a failure is logged and answered as a miss.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from tiercache.integrations.vllm.connector.admission import HitAdmission
from tiercache.integrations.vllm.connector.events import stored_events
from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.groups import (
    NULL_BLOCK,
    kept_positions,
    paired,
    tokens_by_tier,
)
from tiercache.integrations.vllm.connector.jobs import InFlightJob, InFlightLoad, InFlightStore
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.metrics import TIER_SEPARATOR, SchedulerCounters
from tiercache.integrations.vllm.connector.namespace import block_extra
from tiercache.integrations.vllm.connector.options import LoadMode
from tiercache.integrations.vllm.connector.requests import Fetching, RequestKeys, RequestState
from tiercache.integrations.vllm.connector.step_budget import StoreBudget
from tiercache.manager.lower_tiers import LowerTiers

log = logging.getLogger(__name__)


class _StoreBlock(NamedTuple):
    """A block a store keeps: its key, its group, vLLM's block id and its position in the request."""

    key: bytes
    group: int
    block: int
    position: int


class ConnectorScheduler:
    """The scheduler's half of the connector (see the module docstring)."""

    def __init__(self, tiers: LowerTiers, geometry: SlotGeometry, force_latest: bool, *, events: bool = False,
                 idle_wait_s: float = 0.0, load_mode: LoadMode = LoadMode.AUTO,
                 store_budget: StoreBudget | None = None) -> None:
        self.tiers = tiers
        self.geometry = geometry
        self.events: list[Any] | None = [] if events else None
        """vLLM KV events of what the CPU tier took (None: vLLM's KV events are off)."""
        self.world = geometry.world
        self.block_size = geometry.block_size
        self.requests: dict[str, RequestState] = {}
        self._in_flight: dict[int, InFlightJob] = {}
        self._loads_out = 0
        """Load jobs among ``_in_flight`` (asked every admission while vLLM idles: counted, never searched)."""
        self._loads: list[CopyJob] = []
        """Loads admitted since the last step's metadata."""
        self._job_ids = itertools.count()
        self._event_group = next((i for i, g in enumerate(geometry.groups) if g.kind is GroupKind.FULL), None)
        """The group whose stores are reported as KV events (the first full-attention one; none: no events)."""
        self.counters = SchedulerCounters()
        self.store_budget = store_budget or StoreBudget(geometry, None, None)
        """What one step's stores may stage on the workers' devices (unbounded where nothing is staged: CPU)."""
        self.admission = HitAdmission(tiers, geometry, self.counters, force_latest=force_latest,
                                      idle_wait_s=idle_wait_s, load_mode=load_mode,
                                      loads_in_flight=self._loads_in_flight)

    # ---- admission -----------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that tiercache can load now (None: ask again), and whether asynchronously
        (``admission``)."""
        return self.admission.matched_tokens(self._state(request), num_computed_tokens)

    def _loads_in_flight(self) -> bool:
        return self._loads_out > 0

    def track(self, request: Any) -> None:
        """Keep a request tiercache does not load for (a kv_producer's): its blocks are still stored."""
        self._state(request)

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (per group): pair the offered slots with the blocks that take them.
        The remotes' answers kept for its lookups go now (a preempted request that comes back asks again)."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        self.tiers.forget(request.request_id)
        if not isinstance(state.admission, Fetching):
            return
        fetching = state.admission
        count = num_external_tokens // self.block_size
        if not count:
            state.drop_admission()
            return
        end = fetching.skip + count
        pairs = paired(fetching.entries, fetching.offer, block_ids, end)
        invalid: tuple[int, ...] = ()
        if count != fetching.offered and self.geometry.hybrid:  # a window of another end: recomputed, never served
            pairs = [pair for pair in pairs if self.geometry.groups[pair.group].kind is GroupKind.FULL]
            invalid = tuple(
                block for group, blocks in enumerate(block_ids) for block in blocks[fetching.skip : end]
                if block != NULL_BLOCK and self.geometry.groups[group].kind is not GroupKind.FULL
            )
        job = CopyJob(next(self._job_ids), tuple(p.slot for p in pairs), tuple(p.block for p in pairs),
                      tuple(p.group for p in pairs), invalid, request.request_id, fetching.asynchronous,
                      fetching.fetch.region)
        if fetching.asynchronous:
            self.counters.add("async_loads")
        fetch = state.admitted()
        assert fetch is not None
        self._in_flight[job.job_id] = InFlightLoad(fetch=fetch, request_id=request.request_id)
        self._loads_out += 1
        self._loads.append(job)
        self.counters.add("loaded_blocks", len(pairs))
        self.counters.add("loaded_bytes", self._bytes(job.groups))
        for tier in fetching.tiers[: len(fetching.entries)]:
            self.counters.add(f"hit_blocks{TIER_SEPARATOR}{tier}")
        state.hit_tokens = tokens_by_tier(fetching.entries, fetching.tiers, self.tiers.names, end, self.block_size)

    def hit_tokens(self, req_id: str) -> dict[int, int]:
        """The tokens of ``req_id``'s last load by tier index (once: vLLM asks right after allocating)."""
        state = self.requests.get(req_id)
        if state is None:
            return {}
        tokens, state.hit_tokens = state.hit_tokens, {}
        return tokens

    def has_pending(self) -> bool:
        """Whether jobs sent to the workers are not yet reported by every one of them."""
        return bool(self._in_flight)

    def _bytes(self, groups: Iterable[int]) -> int:
        """The bytes a job copies between vLLM's blocks and the CPU tier (every rank's pages of its blocks)."""
        return sum(self.geometry.group_bytes(group) for group in groups)

    # ---- each step -----------------------------------------------------------------------
    def step_metadata(self, output: Any, *, store: bool = True) -> TierCacheConnectorMetadata:
        """This step's jobs: the loads admitted, and (``store``: not a kv_consumer) stores of the blocks this step
        fills."""
        self.tiers.flush_presence()  # the presence checks this step's lookups queued: one batch, one hand-off
        metadata = TierCacheConnectorMetadata(loads=self._loads)
        self._loads = []
        self.admission.idle = not output.num_scheduled_tokens
        self.store_budget.begin_step()
        for new in output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.stores.block_ids = [list(blocks) for blocks in new.block_ids]
                state.stores.computed = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for position, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            progress, blocks = state.stores, cached.new_block_ids[position]
            if req_id in cached.resumed_req_ids:
                progress.block_ids = [list(group) for group in blocks] if blocks else []
            elif blocks:
                for group, new_ids in enumerate(blocks):
                    progress.block_ids[group].extend(new_ids)
            progress.computed = cached.num_computed_tokens[position]
        for req_id, scheduled in output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is not None and store and state.stores.block_ids:
                job = self._store_job(state, state.stores.computed + scheduled)
                if job is not None:
                    metadata.stores.append(job)
        return metadata

    def _store_job(self, state: RequestState, computed: int) -> CopyJob | None:
        """Slots for the blocks each group keeps that are full once ``computed`` tokens have their KV (None: none
        to store)."""
        progress = state.stores
        full = min(computed, len(state.request.all_token_ids)) // self.block_size
        if not progress.stored:
            progress.stored = [0] * len(self.geometry.groups)
        elif full <= min(progress.stored):
            return None  # no block filled since the last store (a decode step, 15 times in 16)
        prompt_blocks = state.request.num_prompt_tokens // self.block_size
        wanted: list[_StoreBlock] = []
        for group, blocks in enumerate(progress.block_ids):
            end = min(full, len(blocks))
            keys = self.admission.group_keys(state, group, end)
            for position in kept_positions(self.geometry, group, progress.stored[group], end, prompt_blocks):
                if blocks[position] != NULL_BLOCK:
                    wanted.append(_StoreBlock(keys[position], group, blocks[position], position))
            progress.stored[group] = max(progress.stored[group], end)
        if not wanted:
            return None
        region = self.tiers.region_token  # the region the slots will be in (a host server's, checked after)
        chosen, left = self._within_budget(wanted)
        for block in left:
            later = self.store_budget.ever_fits(block.group)  # a block past a whole step's budget would wait forever
            if later and self.geometry.groups[block.group].kind is GroupKind.FULL:  # still the request's: a later step
                progress.stored[block.group] = min(progress.stored[block.group], block.position)
                self.counters.add("deferred_store_blocks")
            else:
                self.counters.add("dropped_store_blocks")
        if chosen and self.tiers.region_token != region:  # a host server restarted while the slots were asked for
            self.tiers.end_writes([block.key for block, _ in chosen], [slot for _, slot in chosen],
                                  [False] * len(chosen))
            self.counters.add("dropped_store_blocks", len(chosen))
            return None
        if not chosen:
            return None
        job = CopyJob(next(self._job_ids), tuple(slot for _, slot in chosen),
                      tuple(block.block for block, _ in chosen), tuple(block.group for block, _ in chosen),
                      region=region)
        self._in_flight[job.job_id] = InFlightStore(
            request=state.request, keys=[block.key for block, _ in chosen], slots=list(job.slots),
            positions=[block.position for block, _ in chosen if block.group == self._event_group],
        )
        self.counters.add("stored_blocks", len(chosen))
        self.counters.add("stored_bytes", self._bytes(job.groups))
        return job

    def _within_budget(self, wanted: list[_StoreBlock]) -> tuple[list[tuple[_StoreBlock, int]], list[_StoreBlock]]:
        """CPU slots for ``wanted`` in order while the step's staging lasts (a block the CPU tier holds already costs
        nothing); the blocks past it."""
        chosen: list[tuple[_StoreBlock, int]] = []
        groups = [block.group for block in wanted]
        start = 0
        while start < len(wanted):
            count = self.store_budget.fitting(groups, start)
            if not count:
                break
            batch = wanted[start : start + count]
            for block, slot in zip(batch, self.tiers.begin_writes([block.key for block in batch]), strict=True):
                if slot is not None:
                    chosen.append((block, slot))
                    self.store_budget.spend(block.group)
            start += count
        return chosen, wanted[start:]

    def workers_reported(self, report: TierCacheWorkerMetadata | None) -> None:
        """Act on the jobs every worker has finished (or one has failed)."""
        if report is None:
            return
        stores: list[InFlightStore] = []
        for counts, failed in ((report.done, False), (report.failed, True)):
            for job_id, count in counts.items():
                job = self._in_flight.get(job_id)
                if job is not None and job.reported(count, failed, self.world):
                    del self._in_flight[job_id]
                    if isinstance(job, InFlightLoad):
                        self._finish_load(job)
                    else:
                        stores.append(job)
        if stores:
            self._finish_stores(stores)

    def _finish_load(self, job: InFlightLoad) -> None:
        self._loads_out -= 1
        job.fetch.release()
        if job.failed:
            self.counters.add("failed_loads")
            state = self.requests.get(job.request_id)
            if state is not None:
                state.load_failed = True

    def _finish_stores(self, jobs: list[InFlightStore]) -> None:
        """The step's stores every worker finished, committed in one call (one hand-off to the remotes' writes)."""
        self.tiers.end_writes([key for job in jobs for key in job.keys], [slot for job in jobs for slot in job.slots],
                              [not job.failed for job in jobs for _ in job.keys])
        for job in jobs:
            if job.failed:
                self.counters.add("failed_stores")
            elif self.events is not None:
                self.events.extend(stored_events(job.request, job.positions, self.block_size, self.tiers.names[0]))

    def take_events(self) -> list[Any]:
        """The KV events since the last call."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def finished(self, request: Any) -> None:
        """A request finished or was aborted (allocated or not): what only it held goes (jobs in flight finish on
        their own)."""
        state = self.requests.pop(request.request_id, None)
        if state is not None:
            state.drop_admission()
            self.tiers.forget(request.request_id)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Preempted requests lose their blocks; when resumed, vLLM asks again (what was stored stays)."""
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.stores.block_ids, state.stores.computed = [], 0

    def close(self) -> None:
        for state in self.requests.values():
            state.drop_admission()
        self.requests.clear()
        for job in self._in_flight.values():
            if isinstance(job, InFlightLoad):
                job.fetch.release()
        self._in_flight.clear()
        self._loads_out = 0
        self.tiers.close()

    # ---- keys ----------------------------------------------------------------------------
    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            lora = getattr(request, "lora_request", None)
            extra = block_extra(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None))
            state = self.requests[request.request_id] = RequestState(RequestKeys(request, extra))
        return state
