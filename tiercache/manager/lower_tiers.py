"""LowerTiers: the CPU tier and the remote tiers of a topology, under an engine that keeps its own GPU pool.

An engine with its own paged KV pool and its own process for the copies (vLLM's
KV connector: the scheduler in one process, the workers that own the KV tensors
in others) hands tiercache everything below the pool: the CPU tier, with its
policy and write policies, and the remote tiers, with their lanes, presence cache, cost
model and events. The engine's scheduler asks it, never waiting:

* ``lookup(keys)``: the longest prefix the CPU tier and the remotes hold, per
  position (None while a remote's answer is in flight); it pins the CPU slots it
  counts, as ``TierManager.lookup`` does;
* ``fetch(hit, count)``: the first ``count`` blocks of a hit in CPU slots, pinned
  for the engine: CPU-resident ones at once, remote ones read in the background
  (``HostFetch.ready``); the engine copies them into its pool, then ``release``;
* ``begin_writes(keys)`` / ``end_writes``: CPU slots for blocks the engine
  computed; once it has copied them in, they are committed and written down to
  the remotes by their write policies;
* ``reset_cpu_tier()``: an operator's cache reset (vLLM's ``reset_cache``): the CPU
  tier's entries nothing holds are dropped, the held ones stay valid, the remotes are untouched.

The CPU tier's memory may be the caller's (``cpu_buffer``, e.g. a shared-memory
region the engine's workers map), slot ``i`` being row ``i`` of it. Everything
else is the same as under a ``TierManager``: the same parts, wired by the stack.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiercache.bookkeeping.load_plan import LoadItem
from tiercache.config import TierCacheConfig
from tiercache.manager.books import Books
from tiercache.manager.lookup import Found
from tiercache.manager.stack import Stack
from tiercache.remote.answers import resolved
from tiercache.remote.build import START_TIMEOUT_S

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HostHit:
    """What ``LowerTiers.lookup`` found: per position of the prefix, the tier serving it; its pins."""

    keys: list[bytes]
    found: Found

    @property
    def num_blocks(self) -> int:
        return len(self.found.tiers)

    @property
    def tiers(self) -> list[str]:
        return self.found.tiers


@dataclass(eq=False)
class HostFetch:
    """Blocks being brought into pinned CPU slots for the engine to copy out of."""

    items: list[LoadItem]
    arrived: concurrent.futures.Future[list[bool]]
    _release: Callable[[list[LoadItem]], None]

    region = b""
    """The region its slots are in: the caller's own buffer (a host server's fetch names its region's token)."""

    def ready(self) -> bool:
        """Every block has arrived or failed."""
        return self.arrived.done()

    def slots(self) -> list[int]:
        """The CPU slots of the leading blocks the engine may copy now: those that arrived once the fetch has
        ended, else those that were in the CPU tier from the start (the rest may still arrive, warming the tier)."""
        if not self.arrived.done():
            count = next((i for i, item in enumerate(self.items) if item.staged or not item.pinned), len(self.items))
        elif self.arrived.cancelled() or self.arrived.exception() is not None:
            return []
        else:
            oks = self.arrived.result()
            count = next((i for i, ok in enumerate(oks) if not ok), len(oks))
        return [item.cpu_slot for item in self.items[:count]]

    def wait(self, timeout_s: float) -> bool:
        """Block until every block has arrived or failed, at most ``timeout_s``; whether it has."""
        concurrent.futures.wait([self.arrived], timeout=timeout_s)
        return self.arrived.done()

    def release(self) -> None:
        """The engine is done with the slots (or will not use them): their pins go, once the fetch has ended."""
        if self.arrived.done():
            self._release(self.items)
        else:
            self.arrived.add_done_callback(lambda _: self._release(self.items))


class LowerTiers:
    """The tiers below an engine's own GPU pool (see the module docstring)."""

    def __init__(self, config: TierCacheConfig, *, cpu_buffer: torch.Tensor | None = None) -> None:
        if not config.tiers or config.tiers[0].type != "cpu":
            raise ValueError("LowerTiers needs a topology whose first tier is the CPU tier (config_from_dict(..., "
                             "engine_pool=True)); a topology with a GPU pool is a TierManager's")
        self.parts = Stack(config, cpu_buffer=cpu_buffer)
        """Every part of the topology, for tools and tests that look inside."""
        self._books: Books = self.parts.books
        self.config, self.namespace, self.hasher = config, self.parts.namespace, self.parts.hasher
        self.block_size = self.parts.block_size
        self.bytes_per_block = self.parts.layout.bytes_per_block
        self.names = self.parts.names
        """Every tier's name, fastest first (the CPU tier, then the remotes)."""
        self.types = [tier.type for tier in config.tiers]
        """Every tier's type, as ``names``."""
        self.region_token = b""
        """The region the slots it names are in: the caller's own buffer (``HostTiers`` names its server's)."""
        self._started = self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the background loop and connect the remote tiers, waiting at most ``timeout_s`` (a remote still
        connecting, or unreachable, reads as misses until it answers)."""
        if not self._started:
            self._started = True
            self.parts.runtime.start_with(self.parts.start_remotes(), timeout_s, "lower tiers")

    def close(self) -> None:
        """Finish or drop work in flight (bounded), close the remotes, stop."""
        if self._started and not self._closed:
            self._closed = True
            self.parts.close()

    # ---- the engine's calls --------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], *, local_only: bool = False, asker: Hashable | None = None,
               send: bool = True) -> HostHit | None:
        """The longest prefix of ``keys`` the CPU tier and the remotes hold; None while a remote's answer is in
        flight (ask again, or ``wait_for_answers``). Pins its CPU slots until ``fetch`` or ``release``. ``asker``
        (a request): the remotes' answers are kept for its later lookups until ``forget``. ``send=False``: the
        presence checks of keys not asked before wait for ``flush_presence`` (a scheduler step's requests then
        share one batch and one hand-off to the background loop)."""
        found = self._books.find(list(keys), local_only=local_only or self._closed, asker=asker, send=send)
        return None if found is None else HostHit(list(keys), found)

    def ask(self, keys: Sequence[bytes], asker: Hashable, *, send: bool = True) -> None:
        """Start the remotes' presence checks of ``keys`` that ``asker``'s later lookups will need, in one batch
        (a request that looks up several ends of a hit asks once)."""
        if not self._closed:
            self._books.ask(list(keys), asker, send=send)

    def flush_presence(self) -> None:
        """Send the presence checks lookups queued (``send=False``) since the last flush, in one batch."""
        if not self._closed:
            self._books.flush_presence()

    def forget(self, asker: Hashable) -> None:
        """``asker`` is done: the remote answers kept only for it go."""
        self._books.forget(asker)

    def wait_for_answers(self, timeout_s: float) -> bool:
        """Block until a presence check in flight has answered, at most ``timeout_s``; whether one had (for an
        engine with nothing else to do than wait for it, instead of asking again in a busy loop)."""
        answered = self._books.answer_signal()  # what lookups queued is sent, then waited for too
        return answered is not None and answered.wait(timeout_s)

    def release(self, hit: HostHit) -> None:
        """Drop a hit the engine will not fetch."""
        self._books.release_lookup(hit.found)

    def fetch(self, hit: HostHit, count: int | None = None, *, force_latest: bool = False) -> HostFetch:
        """Bring the first ``count`` blocks of ``hit`` (all by default) into pinned CPU slots; counts its hits."""
        count = hit.num_blocks if count is None else min(count, hit.num_blocks)
        items = self._books.plan_fetch(hit.found, hit.keys[:count], count, force_latest)
        loads = self.parts.loads
        if loads is None or not any(item.staged or not item.pinned for item in items):
            arrived = resolved([item.pinned for item in items])
        else:
            arrived = self.parts.runtime.submit(loads.fetch(items, force_latest))
        return HostFetch(items, arrived, self._books.release)

    def begin_writes(self, keys: Sequence[bytes]) -> list[int | None]:
        """CPU slots for blocks the engine will copy in (None: held already, not admitted yet, or no room)."""
        return self._books.begin_engine_writes(keys)

    def end_writes(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        """The engine copied ``keys`` into ``slots`` (``oks``: which copies landed): commit and write them down."""
        self._books.end_engine_writes(keys, slots, oks)

    def reset_cpu_tier(self) -> int:
        """Drop every CPU-tier entry nothing holds (pins, writes in flight, a remote still owed it: see
        ``Hierarchy.reset_cpu_tier``), each reported as an eviction; how many. Remotes are untouched."""
        return self._books.reset_cpu()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds`` (the cost model's recompute rate)."""
        self._books.observe_prefill(tokens, seconds)

    def buffer_view(self, slot: int) -> memoryview:
        """The bytes of CPU slot ``slot``."""
        cpu = self.parts.cpu
        assert cpu is not None
        return cpu.view(slot)

    def level_blocks(self) -> dict[str, int]:
        """Per codec level (``exact``, ``int8``, ``compact``), the blocks the remote tiers' coded reads filled so
        far: monotone counts any thread may read (tiers without a lossy ``codec`` count nothing)."""
        return self.parts.level_blocks()

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy and counters, queue depths (as ``TierManager.stats``)."""
        return self.parts.stats()

    def subscribe(self, callback: Any) -> Any:
        """``callback(batch)`` gets every ``KVEventBatch`` (needs ``events.enabled``)."""
        if self.parts.events is None:
            raise RuntimeError("KV events are off: set events.enabled in the topology")
        return self.parts.events.subscribe(callback)
