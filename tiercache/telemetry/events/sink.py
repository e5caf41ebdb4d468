"""Where the manager reports every change of what a tier holds; batches reach subscribers off its thread.

The engine-facing calls (``stored``, ``removed``, ``cleared``) only append a tuple
to a bounded deque: no hashing, no encoding, no lock, no wake-up. What a store or
an eviction pays in the engine's loop is that append plus, under CPython's GIL,
a share of the background thread's encoding (benchmarks/events.py measures
both). When the deque is full the event is dropped and counted. A background thread wakes every
``flush_interval_s``, turns everything queued into one ``KVEventBatch`` (keys to
the integers routers expect, token ids to lists), hands it to each in-process
subscriber (a failing callback is logged and counted, never raised) and to the
publisher (ZeroMQ, tiercache.telemetry.events.publisher), which answers replay requests
on a thread of its own.

The sequences passed in (keys, token ids) are read later, on that thread: the
caller must not change them after the call (the manager's key lists are fresh).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tiercache.telemetry.events.config import EventsConfig, EventWire
from tiercache.telemetry.events.lineage import BlockLineage, Chain
from tiercache.telemetry.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    MapKVEventBatch,
    block_hash,
    block_hashes,
    to_map_wire,
)

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
"""Longest ``close`` waits for the background thread to publish what is queued."""
FLUSH_TIMEOUT_S = 5.0
"""Longest ``flush`` waits for the batch it asked for."""

Subscriber = Callable[[KVEventBatch], None]


class _Kind(enum.Enum):
    """What a queued tuple is."""

    STORED = enum.auto()
    REMOVED = enum.auto()
    CLEARED = enum.auto()
    FLUSH = enum.auto()


class BatchPublisher(Protocol):
    """Something that sends batches out of the process (tiercache.telemetry.events.publisher.ZmqEventPublisher)."""

    def publish(self, batch: KVEventBatch | MapKVEventBatch) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, int]: ...


class EventSink:
    """Collects KV events from the engine's thread and delivers them in batches from its own."""

    def __init__(
        self, config: EventsConfig | None = None, publisher: BatchPublisher | None = None, lora_name: str | None = None
    ) -> None:
        self.config = config or EventsConfig(enabled=True)
        self._publisher = publisher
        self.lora_name = lora_name
        """The model's LoRA adapter, named in the map wire's ``BlockStored.lora_name``."""
        self._queue: deque[tuple[Any, ...]] = deque()
        self._subscribers: list[Subscriber] = []
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._lineage = BlockLineage(self.config.lineage_blocks)
        self.dropped = 0
        self.batches = 0
        self.events = 0
        self.callback_errors = 0
        self.publish_errors = 0

    @classmethod
    def from_config(cls, config: EventsConfig, lora_name: str | None = None) -> EventSink:
        """A sink with the ZeroMQ publisher when ``config.endpoint`` is set (needs pyzmq), else in-process only."""
        publisher = None
        if config.endpoint is not None:
            from tiercache.telemetry.events.publisher import ZmqEventPublisher  # pyzmq is the optional 'events' extra

            publisher = ZmqEventPublisher(config)
        return cls(config, publisher, lora_name)

    # --- the engine's thread -------------------------------------------------------------

    def stored(
        self,
        tier: str,
        keys: Sequence[bytes],
        parent_key: bytes | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        lora_id: int | None = None,
    ) -> None:
        """``tier`` now holds ``keys``, consecutive blocks of one chain after ``parent_key``, of ``token_ids``.

        A copy moved by key alone (a demotion, a promotion) passes ``token_ids=None``, in any order: the
        blocks whose first ``stored`` is remembered (``EventsConfig.lineage_blocks``) become one event per
        chain, head first, with that parent and those tokens; the others one event without tokens.
        """
        self._push((_Kind.STORED, tier, keys, parent_key, token_ids, block_size, lora_id))

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        """``tier`` no longer holds ``keys``."""
        self._push((_Kind.REMOVED, tier, keys))

    def cleared(self, tier: str | None = None) -> None:
        """Everything was dropped (``tier``: only that tier; the wire cannot say which, so routers forget all)."""
        self._push((_Kind.CLEARED, tier))

    def _push(self, item: tuple[Any, ...]) -> None:
        # One producer (the engine's thread) appends, the background thread pops: deque's
        # append/popleft are atomic, and the length can only be over-estimated here.
        if len(self._queue) >= self.config.max_queue:
            self.dropped += 1
            return
        self._queue.append(item)

    # --- subscription and life cycle -----------------------------------------------------

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(batch)`` for every batch, on the background thread; returns an unsubscribe."""
        self._subscribers = [*self._subscribers, callback]

        def unsubscribe() -> None:
            self._subscribers = [s for s in self._subscribers if s is not callback]

        return unsubscribe

    def start(self) -> None:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiercache-events", daemon=True)
            self._thread.start()

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Deliver everything queued so far as one batch now; True once delivered (not for the engine's loop)."""
        if self._thread is None:
            return False
        done = threading.Event()
        self._queue.append((_Kind.FLUSH, done))  # never dropped: it carries no event
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Publish what is queued (bounded by ``timeout``), stop the thread, close the publisher."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("events: background thread still running after %.1f s; abandoning it", timeout)
                return
        if self._publisher is not None:
            self._publisher.close()

    def stats(self) -> dict[str, int]:
        """Counters for stats() and Prometheus (the publisher's too, when there is one)."""
        counters = {
            "queued": len(self._queue),
            "dropped": self.dropped,
            "batches": self.batches,
            "events": self.events,
            "callback_errors": self.callback_errors,
            "publish_errors": self.publish_errors,
        }
        if self._publisher is not None:
            counters.update(self._publisher.stats())
        return counters

    # --- the background thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            closing = self._closing
            try:
                self._drain()
            except Exception:  # never let the thread die: count, log, go on
                self.publish_errors += 1
                logger.exception("events: delivering a batch failed")
            if closing:
                return

    def _drain(self) -> None:
        """Turn what is queued into one batch, deliver it, then release any flush waiting on it."""
        events: list[KVEvent] = []
        flushed: list[threading.Event] = []
        queue = self._queue
        for _ in range(len(queue)):
            item = queue.popleft()
            kind = item[0]
            if kind is _Kind.STORED:
                _, tier, keys, parent, tokens, block_size, lora_id = item
                for chain in self._chains_of(keys, parent, tokens, block_size):
                    events.append(
                        BlockStored(
                            block_hashes=block_hashes(chain.keys),
                            parent_block_hash=None if chain.parent is None else block_hash(chain.parent),
                            token_ids=chain.tokens,
                            block_size=block_size,
                            lora_id=lora_id,
                            medium=tier,
                        )
                    )
            elif kind is _Kind.REMOVED:
                events.append(BlockRemoved(block_hashes=block_hashes(item[2]), medium=item[1]))
            elif kind is _Kind.CLEARED:
                events.append(AllBlocksCleared())
            else:
                flushed.append(item[1])
        if events:
            rank = self.config.data_parallel_rank
            self._deliver(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank))
        for done in flushed:
            done.set()

    def _chains_of(
        self, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None, block_size: int
    ) -> list[Chain]:
        """What the stored events say: the chain as given (and remembered), or the chains remembered."""
        if tokens is not None:
            token_ids = _int_list(tokens)
            self._lineage.remember(keys, parent, token_ids, block_size)
            return [Chain(list(keys), parent, token_ids)]
        chains, unknown = self._lineage.chains(keys)
        return [*chains, Chain(unknown, parent, [])] if unknown else chains

    def _deliver(self, batch: KVEventBatch) -> None:
        self.batches += 1
        self.events += len(batch.events)
        for callback in self._subscribers:
            try:
                callback(batch)
            except Exception:
                self.callback_errors += 1
                logger.exception("events: subscriber %r failed", callback)
        if self._publisher is not None:
            try:
                wire = self.config.wire is EventWire.MAP
                self._publisher.publish(to_map_wire(batch, self.lora_name) if wire else batch)
            except Exception:
                self.publish_errors += 1
                logger.exception("events: publishing a batch failed")


def _int_list(tokens: Sequence[int] | Any) -> list[int]:
    """Token ids as a list of Python ints: a list as it is, numpy arrays and tensors through tolist()."""
    if isinstance(tokens, list):
        return tokens
    to_list = getattr(tokens, "tolist", None)
    return to_list() if to_list is not None else [int(t) for t in tokens]
