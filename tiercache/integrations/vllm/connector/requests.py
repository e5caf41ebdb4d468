"""What the scheduler side keeps of one vLLM request, by phase: its keys, its admission and its stores (no I/O).

A request's admission (what it may load beyond vLLM's own prefix-cache hit) is
one of three phases, and ``RequestState`` is the one place that moves it
between them:

- none: nothing is being admitted (never asked, allocated, or nothing to load);
- ``Looking``: ends of a hit are being looked up, from the request's own end
  down (``groups.next_end``), until one is held whole; a remote's answer may be
  in flight (vLLM is told to ask again);
- ``Fetching``: the hit's blocks are being brought into CPU slots (a
  ``HostFetch``, pinned for this request), then offered to vLLM; once vLLM
  allocated blocks for them the fetch moves into a load job, or is released.

Its stores (``StoreProgress``) go on beside: vLLM's block ids per group as the
steps hand them out, and how far each group's stores are planned. Its keys
(``RequestKeys``) are hashed once, extended as tokens are needed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiercache.blocks.keys import BlockHasher
from tiercache.integrations.vllm.connector.groups import HitEntry
from tiercache.manager.lower_tiers import HostFetch


@dataclass(eq=False)
class RequestKeys:
    """A request's chained keys (``extra``: its tenant salt and LoRA), and each group's keys derived from them."""

    request: Any
    extra: str | None
    chain: list[bytes] = field(default_factory=list)
    """The chained keys of its full blocks so far (extended as tokens are needed)."""
    by_group: dict[int, list[bytes]] = field(default_factory=dict)
    """Per group of a model of several, its blocks' keys so far (derived once, whatever the lookups tried)."""

    def chained(self, hasher: BlockHasher, blocks: int) -> list[bytes]:
        """At least the keys of the request's first ``blocks`` full blocks, those first (hashing only what is new):
        the chain itself, never a copy, for a running request asks every step."""
        if len(self.chain) < blocks:
            size = hasher.block_size
            new = self.request.all_token_ids[len(self.chain) * size : blocks * size]
            parent = self.chain[-1] if self.chain else None
            self.chain.extend(hasher.keys(new, self.extra, parent=parent))
        return self.chain

    def of_group(self, hasher: BlockHasher, group: int, blocks: int, derive: Callable[[bytes, int], bytes] | None
                 ) -> list[bytes]:
        """At least the keys of ``group``'s first ``blocks`` blocks, those first (``derive``: a chained key -> the
        group's; None: one group, whose keys are the chained ones)."""
        chain = self.chained(hasher, blocks)
        if derive is None:
            return chain
        derived = self.by_group.setdefault(group, [])
        derived.extend(derive(key, group) for key in itertools.islice(chain, len(derived), None))
        return derived


@dataclass(eq=False)
class Looking:
    """Ends of a hit being looked up (vLLM holding the first ``skip`` blocks)."""

    skip: int
    end: int = 0
    """The end being looked up, in blocks (0: not chosen yet: the request's own end)."""
    tries: int = 0
    """Ends looked up and found not whole (``groups.next_end``)."""
    asked: bool = False
    """The presence checks of every end it may try have been sent (a hybrid model's lookup)."""
    started: float = field(default_factory=time.monotonic)
    """When the lookup began (``time.monotonic``)."""


@dataclass(eq=False)
class Fetching:
    """A hit of blocks ``skip..end`` being brought into CPU slots, then offered to vLLM."""

    skip: int
    end: int
    entries: list[HitEntry]
    """The (group, position) of each block of the fetch."""
    fetch: HostFetch
    tiers: list[str]
    """Per block of the fetch, the tiercache tier serving it."""
    asked_at: float
    """When the fetch started (``time.monotonic``): how long the request may still wait for it."""
    offer: list[int] = field(default_factory=list)
    """The CPU slots offered to vLLM as external tokens (one per entry)."""
    offered: int = 0
    """The blocks offered to vLLM as external tokens."""
    asynchronous: bool = False
    """The offer was an asynchronous load (vLLM waits for the workers' report before it schedules the request)."""


Admission = Looking | Fetching


@dataclass(eq=False)
class StoreProgress:
    """vLLM's blocks of a request per group, and how far its stores are planned."""

    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV-cache group, vLLM's block ids by position."""
    computed: int = 0
    """Tokens vLLM had computed at the start of the last step."""
    stored: list[int] = field(default_factory=list)
    """Per group, positions below this have a store planned (or are held already)."""


@dataclass(eq=False)
class RequestState:
    """One vLLM request: its keys, its admission phase, its stores and what its last load reported."""

    keys: RequestKeys
    admission: Admission | None = None
    stores: StoreProgress = field(default_factory=StoreProgress)
    load_failed: bool = False
    """A load of its failed: vLLM recomputes what it misses, and the request is never offered a load again (a
    failing worker would fail the retry too)."""
    hit_tokens: dict[int, int] = field(default_factory=dict)
    """The last load's tokens by tier index (a position counts under the farthest tier any of its blocks came
    from), for vLLM's ``get_external_cache_hit_sources``."""

    @property
    def request(self) -> Any:
        return self.keys.request

    def admission_for(self, skip: int) -> Admission:
        """The admission for vLLM's hit of ``skip`` blocks: the one under way, or a new lookup (an admission of
        another ``skip`` no longer lines up: dropped)."""
        if self.admission is not None and self.admission.skip != skip:
            self.drop_admission()
        if self.admission is None:
            self.admission = Looking(skip)
        return self.admission

    def fetching(self, fetching: Fetching) -> None:
        """A lookup found a hit held whole: its fetch is under way."""
        self.admission = fetching

    def admitted(self) -> HostFetch | None:
        """vLLM allocated for the hit: the fetch leaves the request (to a load job, or to be released)."""
        admission, self.admission = self.admission, None
        return admission.fetch if isinstance(admission, Fetching) else None

    def drop_admission(self) -> None:
        """Give up what is being admitted (the fetch's pins released)."""
        fetch = self.admitted()
        if fetch is not None:
            fetch.release()
