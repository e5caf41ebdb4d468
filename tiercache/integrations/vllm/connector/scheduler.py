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
from typing import Any, NamedTuple

from tiercache.common.units import US_PER_SECOND
from tiercache.integrations.vllm.connector.events import stored_events
from tiercache.integrations.vllm.connector.geometry import GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.groups import (
    NULL_BLOCK,
    group_key,
    hit_entries,
    kept_positions,
    next_end,
    paired,
    tokens_by_tier,
)
from tiercache.integrations.vllm.connector.jobs import InFlightJob, InFlightLoad, InFlightStore
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.metrics import TIER_SEPARATOR, SchedulerCounters
from tiercache.integrations.vllm.connector.namespace import block_extra
from tiercache.integrations.vllm.connector.requests import Fetching, Looking, RequestKeys, RequestState
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
                 idle_wait_s: float = 0.0) -> None:
        self.tiers = tiers
        self.geometry = geometry
        self.events: list[Any] | None = [] if events else None
        """vLLM KV events of what the CPU tier took (None: vLLM's KV events are off)."""
        self.world = geometry.world
        self.force_latest = force_latest
        self.block_size = geometry.block_size
        self.queues = tiers.config.queues
        self.requests: dict[str, RequestState] = {}
        self._in_flight: dict[int, InFlightJob] = {}
        self._loads: list[CopyJob] = []
        """Loads admitted since the last step's metadata."""
        self._job_ids = itertools.count()
        self._event_group = next((i for i, g in enumerate(geometry.groups) if g.kind is GroupKind.FULL), None)
        """The group whose stores are reported as KV events (the first full-attention one; none: no events)."""
        self._derive = None if len(geometry.groups) == 1 else self._group_key
        """A chained key -> a group's key (None: one group, whose keys are the chained ones)."""
        self.idle_wait_s = idle_wait_s
        self._idle = True
        """vLLM's last step scheduled nothing (a request's admission may wait instead of answering "ask again")."""
        self.counters = SchedulerCounters()

    # ---- admission -----------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that tiercache can load now (None: ask again). While vLLM has nothing else
        to run (its last step scheduled nothing), it waits for the remote's answer or the fetch up to
        ``idle_wait_s`` instead of answering "ask again" to a busy loop that takes the CPU the fetch needs."""
        state = self._state(request)
        usable = (request.num_tokens - 1) // self.block_size  # a sync load leaves a token to compute
        skip = num_computed_tokens // self.block_size
        state.admission_for(skip)  # vLLM's own hit moved: a lookup or fetch no longer lines up
        if usable <= skip:
            return 0, False
        deadline = time.monotonic() + (self.idle_wait_s if self._may_block() else 0.0)
        while True:
            tokens = self._advance(state, usable)
            if tokens is not None or not self._wait(state, deadline):
                break
        if tokens is None:
            pending = "lookups_pending" if isinstance(state.admission, Looking) else "fetches_pending"
            self.counters.add(pending)
        return tokens, False

    def _advance(self, state: RequestState, usable: int) -> int | None:
        """One step of the request's admission, never waiting: the tokens to offer, or None (not yet)."""
        admission = state.admission
        if isinstance(admission, Looking):
            found = self._find(state, admission, min(admission.end or usable, usable))
            if found is None:
                return None
            self.counters.add("lookups")
            if not found:
                return 0
        fetching = state.admission
        assert isinstance(fetching, Fetching)
        if not fetching.fetch.ready() and self._may_wait(fetching):
            return None
        slots = fetching.fetch.slots()
        groups = len(self.geometry.groups)
        whole = fetching.end - fetching.skip
        if len(slots) == len(fetching.entries):
            fetching.offered = whole
        else:  # a prefix of whole positions, where no window is needed (else no block of this hit is any use)
            fetching.offered = 0 if self.geometry.hybrid else len(slots) // groups
        fetching.offer = slots if fetching.offered == whole else slots[: fetching.offered * groups]
        self.counters.add("offered_blocks", fetching.offered)
        self.counters.add("fetch_us", _micros(time.monotonic() - fetching.asked_at))
        return fetching.offered * self.block_size

    def _may_block(self) -> bool:
        """Whether vLLM would only spin if asked to ask again: its last step ran nothing, and no load of this
        connector is in flight (its report would wait for the next step)."""
        return self._idle and self.idle_wait_s > 0 and not any(
            isinstance(job, InFlightLoad) for job in self._in_flight.values())

    def _wait(self, state: RequestState, deadline: float) -> bool:
        """Wait until ``deadline`` at most for what the request's admission waits on; whether to try again."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        started = time.monotonic()
        admission = state.admission
        if isinstance(admission, Fetching):
            admission.fetch.wait(left)
        elif not self.tiers.wait_for_answers(left):
            return False  # nothing in flight to wait for: a local answer is final
        self.counters.add("idle_wait_us", _micros(time.monotonic() - started))
        return True

    def _find(self, state: RequestState, looking: Looking, end: int) -> bool | None:
        """Look up ends from ``end`` down until one is held whole (the request then fetches it) or none is left
        (False); None while a remote's answer is in flight (``looking.end`` says where to go on)."""
        geometry = self.geometry
        asker = state.request.request_id
        if geometry.hybrid and not looking.asked:  # every end it may try, in one batch of presence checks
            self.tiers.ask(self._candidate_keys(state, looking.skip, end), asker)
            looking.asked = True
        while True:
            looking.end = end
            entries = hit_entries(geometry, looking.skip, end)
            keys = {group: self._group_keys(state, group, end) for group in range(len(geometry.groups))}
            hit = self.tiers.lookup([keys[entry.group][entry.position] for entry in entries], local_only=not entries,
                                    asker=asker)
            if hit is None:
                return None
            if hit.num_blocks == len(entries) or (hit.num_blocks and not geometry.hybrid):
                break
            self.tiers.release(hit)
            looking.tries += 1
            following = next_end(geometry, looking.skip, entries[hit.num_blocks].position, looking.tries)
            if following is None:
                state.drop_admission()
                return False
            end = following
        if not geometry.hybrid:  # a prefix of whole positions is a hit too
            positions = hit.num_blocks // len(geometry.groups)
            if not positions:
                self.tiers.release(hit)
                state.drop_admission()
                return False
            end, entries = looking.skip + positions, entries[: positions * len(geometry.groups)]
        fetch = self.tiers.fetch(hit, len(entries), force_latest=self.force_latest)
        now = time.monotonic()
        self.counters.add("lookup_us", _micros(now - looking.started))
        state.fetching(Fetching(looking.skip, end, entries, fetch, list(hit.tiers[: len(entries)]), now))
        return True

    def _candidate_keys(self, state: RequestState, skip: int, end: int) -> list[bytes]:
        """The keys of every group's blocks from ``skip`` to ``end``: whatever end a hybrid lookup tries."""
        return [key for group in range(len(self.geometry.groups)) for key in self._group_keys(state, group, end)[skip:]]

    def track(self, request: Any) -> None:
        """Keep a request tiercache does not load for (a kv_producer's): its blocks are still stored."""
        self._state(request)

    def _may_wait(self, fetching: Fetching) -> bool:
        """Whether a request may still be held back for its remote blocks (the topology's prefetch policy)."""
        waited = time.monotonic() - fetching.asked_at
        return waited < self.queues.prefetch_wait_s(len(fetching.fetch.items) * self.block_size)

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (per group): pair the offered slots with the blocks that take them."""
        state = self.requests.get(request.request_id)
        if state is None or not isinstance(state.admission, Fetching):
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
                if block != NULL_BLOCK and self.geometry.groups[group].kind is GroupKind.SLIDING
            )
        job = CopyJob(next(self._job_ids), tuple(p.slot for p in pairs), tuple(p.block for p in pairs),
                      tuple(p.group for p in pairs), invalid)
        fetch = state.admitted()
        assert fetch is not None
        self._in_flight[job.job_id] = InFlightLoad(fetch=fetch)
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
        metadata = TierCacheConnectorMetadata(loads=self._loads)
        self._loads = []
        self._idle = not output.num_scheduled_tokens
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
        prompt_blocks = state.request.num_prompt_tokens // self.block_size
        wanted: list[_StoreBlock] = []
        for group, blocks in enumerate(progress.block_ids):
            end = min(full, len(blocks))
            keys = self._group_keys(state, group, end)
            for position in kept_positions(self.geometry, group, progress.stored[group], end, prompt_blocks):
                if blocks[position] != NULL_BLOCK:
                    wanted.append(_StoreBlock(keys[position], group, blocks[position], position))
            progress.stored[group] = max(progress.stored[group], end)
        if not wanted:
            return None
        slots = self.tiers.begin_writes([block.key for block in wanted])
        chosen = [(block, slot) for block, slot in zip(wanted, slots, strict=True) if slot is not None]
        if not chosen:
            return None
        job = CopyJob(next(self._job_ids), tuple(slot for _, slot in chosen),
                      tuple(block.block for block, _ in chosen), tuple(block.group for block, _ in chosen))
        self._in_flight[job.job_id] = InFlightStore(
            request=state.request, keys=[block.key for block, _ in chosen], slots=list(job.slots),
            positions=[block.position for block, _ in chosen if block.group == self._event_group],
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
                job = self._in_flight.get(job_id)
                if job is not None and job.reported(count, failed, self.world):
                    self._finish(self._in_flight.pop(job_id))

    def _finish(self, job: InFlightJob) -> None:
        if isinstance(job, InFlightLoad):
            job.fetch.release()
            if job.failed:
                self.counters.add("failed_loads")
            return
        self.tiers.end_writes(job.keys, job.slots, [not job.failed] * len(job.keys))
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
        """A request finished or was aborted: what only it held goes (jobs in flight finish on their own)."""
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
        self.tiers.close()

    # ---- keys ----------------------------------------------------------------------------
    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            lora = getattr(request, "lora_request", None)
            extra = block_extra(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None))
            state = self.requests[request.request_id] = RequestState(RequestKeys(request, extra))
        return state

    def _group_keys(self, state: RequestState, group: int, blocks: int) -> list[bytes]:
        """The keys of ``group``'s first ``blocks`` blocks of the request (the chained keys for a one-group model)."""
        return state.keys.of_group(self.tiers.hasher, group, blocks, self._derive)

    def _group_key(self, key: bytes, group: int) -> bytes:
        return group_key(key, group, self.geometry)


def _micros(seconds: float) -> int:
    return round(seconds * US_PER_SECOND)
