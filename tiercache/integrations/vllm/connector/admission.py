"""Admitting a request's hit: looking its blocks up, fetching them into CPU slots, offering them to vLLM.

For each request vLLM asks about (``get_num_new_matched_tokens``), the hit
beyond vLLM's own prefix-cache hit, per KV-cache group (``groups``: every block
of a full-attention group, a sliding group's window before the end; the longest
end held whole, tried end by end, every end's presence asked in one batch). The
presence checks a step's lookups need are sent together when the step's metadata
is built (``LowerTiers.flush_presence``): one batch and one hand-off to the
background loop a step, whatever the requests arriving.
CPU-resident blocks are pinned at once; blocks only a remote holds are read into
CPU slots in the background while vLLM is told to ask again (``None``), as long
as the topology's prefetch policy lets a request wait
(``QueueConfig.prefetch_wait_s``). While vLLM's last step ran nothing, it waits
for the remote (``idle_wait_s``) rather than answer "ask again" to a busy loop.
The offer is whole blocks that leave at least one prompt token to compute, a
synchronous or an asynchronous load (``LoadMode``). The request's phases are
moved by ``requests.RequestState``; this class only reads and answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tiercache.common.units import US_PER_SECOND
from tiercache.integrations.vllm.connector.geometry import SlotGeometry
from tiercache.integrations.vllm.connector.groups import group_key, hit_entries, next_end
from tiercache.integrations.vllm.connector.metrics import SchedulerCounters
from tiercache.integrations.vllm.connector.options import LoadMode
from tiercache.integrations.vllm.connector.requests import Fetching, Looking, RequestState
from tiercache.manager.lower_tiers import LowerTiers


class HitAdmission:
    """Looks up, fetches and offers requests' hits (see the module docstring)."""

    def __init__(self, tiers: LowerTiers, geometry: SlotGeometry, counters: SchedulerCounters, *,
                 force_latest: bool, idle_wait_s: float, load_mode: LoadMode,
                 loads_in_flight: Callable[[], bool]) -> None:
        self.tiers = tiers
        self.geometry = geometry
        self.counters = counters
        self.force_latest = force_latest
        self.idle_wait_s = idle_wait_s
        self.load_mode = load_mode
        self.loads_in_flight = loads_in_flight
        """Whether a load job is in flight to the workers (its report would wait for the next step)."""
        self.block_size = geometry.block_size
        self.queues = tiers.config.queues
        self.idle = True
        """vLLM's last step scheduled nothing (a request's admission may wait instead of answering "ask again")."""
        self._derive = None if len(geometry.groups) == 1 else self._group_key
        """A chained key -> a group's key (None: one group, whose keys are the chained ones)."""

    def matched_tokens(self, state: RequestState, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that tiercache can load now (None: ask again), and whether asynchronously.
        While vLLM has nothing else to run (its last step scheduled nothing), it waits for the remote's answer or
        the fetch up to ``idle_wait_s`` instead of answering "ask again" to a busy loop that takes the CPU the fetch
        needs."""
        request = state.request
        usable = (request.num_tokens - 1) // self.block_size  # a sync load leaves a token to compute
        skip = num_computed_tokens // self.block_size
        state.admission_for(skip)  # vLLM's own hit moved: a lookup or fetch no longer lines up
        if usable <= skip or state.load_failed:
            return 0, False
        deadline = time.monotonic() + (self.idle_wait_s if self._may_block() else 0.0)
        while True:
            tokens = self._advance(state, usable)
            if tokens is not None or not self._wait(state, deadline):
                break
        if tokens is None:
            pending = "lookups_pending" if isinstance(state.admission, Looking) else "fetches_pending"
            self.counters.add(pending)
            return None, False
        fetching = state.admission
        asynchronous = bool(tokens) and isinstance(fetching, Fetching) and self._asynchronous()
        if asynchronous:
            assert isinstance(fetching, Fetching)
            fetching.asynchronous = True
        return tokens, asynchronous

    def _asynchronous(self) -> bool:
        """Whether an offer is an asynchronous load (``LoadMode``): always for a model of several KV-cache groups,
        whose failed loads vLLM takes per request only (a block-level error there stops its scheduler)."""
        if len(self.geometry.groups) > 1 or self.load_mode is LoadMode.ASYNC:
            return True
        return self.load_mode is LoadMode.AUTO and not self.idle

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
        return self.idle and self.idle_wait_s > 0 and not self.loads_in_flight()

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
            self.tiers.ask(self._candidate_keys(state, looking.skip, end), asker, send=False)
            looking.asked = True
        while True:
            looking.end = end
            entries = hit_entries(geometry, looking.skip, end)
            keys = {group: self.group_keys(state, group, end) for group in range(len(geometry.groups))}
            hit = self.tiers.lookup([keys[entry.group][entry.position] for entry in entries], local_only=not entries,
                                    asker=asker, send=False)  # sent with the step's others (``step_metadata``)
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
        groups = range(len(self.geometry.groups))
        return [key for group in groups for key in self.group_keys(state, group, end)[skip:end]]

    def _may_wait(self, fetching: Fetching) -> bool:
        """Whether a request may still be held back for its remote blocks (the topology's prefetch policy)."""
        waited = time.monotonic() - fetching.asked_at
        return waited < self.queues.prefetch_wait_s(len(fetching.entries) * self.block_size)

    def group_keys(self, state: RequestState, group: int, blocks: int) -> list[bytes]:
        """At least the keys of ``group``'s first ``blocks`` blocks of the request, those first (the chained keys for
        a one-group model)."""
        return state.keys.of_group(self.tiers.hasher, group, blocks, self._derive)

    def _group_key(self, key: bytes, group: int) -> bytes:
        return group_key(key, group, self.geometry)


def _micros(seconds: float) -> int:
    return round(seconds * US_PER_SECOND)
