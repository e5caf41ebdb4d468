"""Per-key remote lookups for vLLM's scheduler: answered from memory, probed in the background.

vLLM asks a secondary tier about one key at a time, in key order, every step
while a request waits, under the manager's lock; the answer must be cheap and
must never wait on the network. ``ProbeBook.lookup`` answers from a dict:

- a key not asked before joins this step's batch and is ``RETRY``; at the end
  of the step (``flush``, from ``on_schedule_end``) the batch goes to the
  ``RemoteStore`` as one probe (one pipelined EXISTS per server), and the
  scheduler asks again next step (vLLM's manager treats a secondary tier's
  ``HIT_PENDING`` like a miss, so ``RETRY`` is the in-flight answer);
- a probe answered ``HELD`` is ``HIT``, ``ABSENT`` is ``MISS`` (remembered
  while a request that asked still runs), ``UNKNOWN`` (a tier could not tell:
  down, slow, breaker open) is ``MISS`` for this request and forgotten, so the
  next request probes again; a probe not answered within its deadline counts as
  ``UNKNOWN``, whatever the network does;
- a failed load marks its failed keys ``MISS`` (``mark_miss``), or vLLM would
  promote them again forever.

Probes in flight are shared by every request that asks for the key, and stay
until answered (so no newer probe of a key ever replaces one in flight). No
thread of its own: the store's loop resolves the futures, and the lookups read
them.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LookupResult, OffloadKey

from tiercache.remote.answers import ABSENT, UNKNOWN, Found
from tiercache.remote.store import RemoteStore
from tiercache.tiers.base import Presence

GIVE_UP_FACTOR = 5.0
"""A probe not answered within this many remote-lookup timeouts counts as UNKNOWN (the lane's deadline
is one timeout plus its queue; this bounds what the scheduler sees if anything below misbehaves)."""


@dataclass(eq=False)
class _Batch:
    """One step's probe: its keys' states, the store's future, when it was sent."""

    probes: list[_Probe]
    future: concurrent.futures.Future[list[Found]] | None = None
    sent: float = 0.0


@dataclass(eq=False)
class _Probe:
    """What is known of one key; ``found`` is None until its batch answers."""

    key: OffloadKey
    batch: _Batch | None = None
    found: Found | None = None
    requests: set[str] = field(default_factory=set)


class ProbeBook:
    """The lookup state of one tier (see the module docstring); call it under vLLM's manager lock."""

    def __init__(self, store: RemoteStore, give_up_s: float) -> None:
        self._store = store
        self._give_up_s = give_up_s
        self._probes: dict[OffloadKey, _Probe] = {}
        self._request_keys: dict[str, set[OffloadKey]] = {}
        self._pending = _Batch([])
        self._in_flight: list[_Batch] = []

    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult:
        """HIT, MISS or RETRY for ``key``, from memory."""
        probe = self._probes.get(key)
        if probe is None:
            probe = _Probe(key, self._pending)
            self._probes[key] = probe
            self._pending.probes.append(probe)
        if req_id not in probe.requests:  # asked again every step while the request waits: nothing to record
            probe.requests.add(req_id)
            self._request_keys.setdefault(req_id, set()).add(key)
        if probe.found is None:
            batch = probe.batch  # set until its answer is applied
            assert batch is not None
            if batch.future is None or not self._settle(batch):
                return LookupResult.RETRY
        found = probe.found
        assert found is not None
        if found.presence is Presence.HELD:
            return LookupResult.HIT
        if found.presence is Presence.UNKNOWN:
            del self._probes[key]  # 'could not tell' is this request's MISS; the next one probes again
        return LookupResult.MISS

    def flush(self) -> None:
        """Send this step's new keys as one probe; settle probes that answered or passed their deadline."""
        for batch in list(self._in_flight):
            self._settle(batch)
        batch, self._pending = self._pending, _Batch([])
        if batch.probes:
            keys = [probe.key for probe in batch.probes]  # mapped into the namespace on the store's loop
            batch.future, batch.sent = self._store.contains(keys, engine_keys=True), time.monotonic()
            self._in_flight.append(batch)

    def _settle(self, batch: _Batch) -> bool:
        """Apply ``batch``'s answer once it has one (or its deadline passed); False while it is in flight."""
        future = batch.future
        assert future is not None
        if future.done():
            try:
                answers = future.result()
            except BaseException:  # a cancelled probe (store closing) reads as 'could not tell'
                answers = [UNKNOWN] * len(batch.probes)
        elif time.monotonic() - batch.sent > self._give_up_s:
            answers = [UNKNOWN] * len(batch.probes)
        else:
            return False
        for probe, found in zip(batch.probes, answers, strict=True):
            probe.batch, probe.found = None, found
            if not probe.requests:
                del self._probes[probe.key]
        self._in_flight.remove(batch)
        return True

    def mark_miss(self, keys: Collection[OffloadKey]) -> None:
        """A load of ``keys`` failed: answer MISS for them while their requests run."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and probe.found is not None:
                probe.found = ABSENT

    def finished(self, req_id: str) -> None:
        """A request finished: drop what only it was asking about (probes in flight stay until answered)."""
        for key in self._request_keys.pop(req_id, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.requests.discard(req_id)
            if not probe.requests and probe.batch is None:
                del self._probes[key]

    @property
    def busy(self) -> bool:
        """Probes waiting to be sent or in flight."""
        return bool(self._pending.probes or self._in_flight)
