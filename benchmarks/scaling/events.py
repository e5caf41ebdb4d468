"""KV events as blocks pile up: what a store pays for them, and how fast batches reach 1 and 8 subscribers.

At each number of blocks held (10^4 to 10^6), three figures, each next to a
reference measured in the same run:

* store cost: two GPU-only managers (the CPU device standing in for the pool),
  events off and events on (a ZeroMQ PUB socket and a replay socket on
  loopback, one real subscriber process reading them), filled with that many
  blocks by stores of ``BLOCKS_PER_STORE``; then ``Sizes.timed_stores`` stores of
  fresh prompts each, the two taking turns. µs per block of ``store``, events off
  (the ceiling), on, and the difference; the reference is a bare ``deque.append``
  of the same tuple per store (the least a queued hand-off can cost);
* ZeroMQ delivery: an ``EventSink`` as operators run it (PUB + replay socket, the
  sink's defaults) that has published events of that many blocks so far, and 1
  or 8 subscriber processes (SUB sockets decoding each batch into vLLM's structs
  with msgspec's typed decoder, as a router does). ``Sizes.delivery_events`` stored
  events (a 64-block prompt each, with its tokens) are pushed in chunks of
  ``CHUNK_EVENTS``, one batch per chunk (``flush``). Events/s: what every
  subscriber received over the time from the first push to its last batch
  (the slowest subscriber's). The reference: a bare PUB socket sending the same
  batches, encoded beforehand, to the same subscribers;
* in-process delivery: ``EventSink.subscribe`` with 1 or 8 callbacks counting
  events and blocks; the reference calls the same callbacks on the same
  batches built beforehand.

Every figure is the median of its rounds; the subscriber processes
(``_event_subscribers.py``) and the sink's thread share this machine's cores
(on 2 cores, 8 subscribers slow the publisher too). The last row also says how
many stored events the events-on manager made and how many its subscriber got.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from scaling._event_subscribers import MARK_END, MARK_QUIT, MARK_READY, Subscribers
from tiercache.common.units import US_PER_SECOND
from tiercache.config import config_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.telemetry.events.config import DEFAULT_HWM, DEFAULT_TOPIC, EventsConfig
from tiercache.telemetry.events.replay import SEQ_BYTES
from tiercache.telemetry.events.sink import EventSink
from tiercache.telemetry.events.wire import BlockRemoved, BlockStored, KVEventBatch, block_hashes
from tiercache.testing.redis_servers import free_port

NAME = "events"
HELD = (10_000, 100_000, 1_000_000)
"""Blocks held (stored so far) at each stage."""
QUICK_HELD = (1_024, 4_096)
BLOCK_SIZE = 16
KEY_BYTES = 16
LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16", "block_size": BLOCK_SIZE}
"""The smallest block (64 bytes): the bookkeeping and events, not the bytes, are measured."""
BLOCKS_PER_STORE = 64
"""One 1024-token prompt of 16-token blocks."""
CHUNK_EVENTS = 64
"""Events per batch in the delivery rounds (stores of one scheduler step of 64 requests)."""
SUBSCRIBERS = (1, 8)
CAPACITY_MARGIN = 2
"""GPU blocks per block held and timed: no store ever evicts."""
TIER = "gpu"
SINK_ID, REFERENCE_ID = 1, 2
"""Which publisher a ready marker comes from (its one block hash)."""
FLUSH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Sizes:
    """How much each stage measures."""

    held: tuple[int, ...]
    """Blocks held (stored so far) at each stage."""
    timed_stores: int
    """Stores timed per manager and stage."""
    delivery_events: int
    """Stored events per delivery round: whole chunks, below the sink's queue bound (so none is dropped)."""
    rounds: int
    """Delivery rounds per publisher and stage."""

    def __post_init__(self) -> None:
        if self.delivery_events % CHUNK_EVENTS:
            raise ValueError(f"delivery_events: a multiple of {CHUNK_EVENTS}, got {self.delivery_events}")


FULL = Sizes(HELD, timed_stores=400, delivery_events=12_800, rounds=3)
QUICK = Sizes(QUICK_HELD, timed_stores=20, delivery_events=256, rounds=1)


class Prompt:
    """One stored event's content, the same prompt's shape as the manager's stores: keys, tokens, and the
    ``BlockStored`` the sink makes of them (for the references)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.keys = [rng.bytes(KEY_BYTES) for _ in range(BLOCKS_PER_STORE)]
        self.tokens = list(range(BLOCKS_PER_STORE * BLOCK_SIZE))
        stored = BlockStored(block_hashes=block_hashes(self.keys), parent_block_hash=None, token_ids=self.tokens,
                             block_size=BLOCK_SIZE, lora_id=None, medium=TIER)
        self.batch = KVEventBatch(ts=time.time(), events=[stored] * CHUNK_EVENTS)
        """A batch of ``CHUNK_EVENTS`` of them, as the sink delivers a chunk."""

    def push(self, sink: EventSink, events: int) -> None:
        """``events`` stored events (rounded up to whole chunks), one batch per chunk (a flush after each)."""
        for _ in range(-(-events // CHUNK_EVENTS)):
            for _ in range(CHUNK_EVENTS):
                sink.stored(TIER, self.keys, None, self.tokens, BLOCK_SIZE)
            if not sink.flush(FLUSH_TIMEOUT_S):
                raise RuntimeError("events: a flush timed out")


def mark(sink: EventSink, medium: str, ident: int = 0) -> None:
    """Deliver a marker event now (its one block hash is ``ident``)."""
    sink.removed(medium, [ident.to_bytes(KEY_BYTES, "big")])
    if not sink.flush(FLUSH_TIMEOUT_S):
        raise RuntimeError("events: a flush timed out")


def slowest(lines: list[dict[str, Any]], started: float, sent: int) -> dict[str, float]:
    """The slowest subscriber's events/s, and the events lost over all of them."""
    return {"events_per_s": min(line["events"] / (line["last_s"] - started) for line in lines),
            "lost": sent * len(lines) - sum(line["events"] for line in lines)}


class ZmqDelivery:
    """The sink (PUB + replay socket) and the reference PUB socket, both on loopback."""

    def __init__(self, prompt: Prompt) -> None:
        self.prompt = prompt
        self.sink_endpoint = f"tcp://127.0.0.1:{free_port()}"
        config = EventsConfig(enabled=True, endpoint=self.sink_endpoint, replay_endpoint="tcp://127.0.0.1:*")
        self.sink = EventSink.from_config(config)
        self.sink.start()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
        self.reference_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.reference_endpoint)
        encoder = msgspec.msgpack.Encoder()
        self.chunk = encoder.encode(prompt.batch)
        self.end, self.ready = (
            encoder.encode(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[ident], medium=medium)]))
            for medium, ident in ((MARK_END, 0), (MARK_READY, REFERENCE_ID))
        )
        self.seq = 0

    def send(self, payload: bytes) -> None:
        """One batch on the reference socket, framed as the sink's publisher frames it."""
        self.pub.send_multipart((DEFAULT_TOPIC.encode(), self.seq.to_bytes(SEQ_BYTES, "big"), payload))
        self.seq += 1

    def measure(self, count: int, sizes: Sizes) -> dict[str, float]:
        """Sink and reference rounds in turn, to ``count`` subscriber processes: the medians of the rounds."""
        subscribers = Subscribers(count, [self.sink_endpoint, self.reference_endpoint])
        sink_rounds, reference_rounds = [], []
        try:
            subscribers.wait_ready(SINK_ID, lambda: mark(self.sink, MARK_READY, SINK_ID))
            subscribers.wait_ready(REFERENCE_ID, lambda: self.send(self.ready))
            for _ in range(sizes.rounds):
                started = time.monotonic()
                self.prompt.push(self.sink, sizes.delivery_events)
                mark(self.sink, MARK_END)
                sink_rounds.append(slowest(subscribers.results(), started, sizes.delivery_events))
                started = time.monotonic()
                for _ in range(sizes.delivery_events // CHUNK_EVENTS):
                    self.send(self.chunk)
                self.send(self.end)
                reference_rounds.append(slowest(subscribers.results(), started, sizes.delivery_events))
        finally:
            mark(self.sink, MARK_QUIT)
            subscribers.close()
        return {"events_per_s": statistics.median(r["events_per_s"] for r in sink_rounds),
                "reference_events_per_s": statistics.median(r["events_per_s"] for r in reference_rounds),
                "lost": sum(r["lost"] for r in sink_rounds), "reference_lost": sum(r["lost"] for r in reference_rounds)}

    def close(self) -> None:
        self.sink.close()
        self.pub.close()
        self.context.destroy(linger=0)


class Counting:
    """An in-process subscriber: counts events and blocks."""

    def __init__(self) -> None:
        self.events = self.blocks = 0

    def __call__(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.events += 1
            self.blocks += len(event.block_hashes)


def callback_delivery(sink: EventSink, count: int, prompt: Prompt, sizes: Sizes) -> dict[str, float]:
    """Events/s to ``count`` callbacks through the sink, and the same callbacks on batches built beforehand."""
    callbacks = [Counting() for _ in range(count)]
    unsubscribes = [sink.subscribe(callback) for callback in callbacks]
    rates, references = [], []
    for _ in range(sizes.rounds):
        started = time.perf_counter()
        prompt.push(sink, sizes.delivery_events)
        rates.append(sizes.delivery_events / (time.perf_counter() - started))
        started = time.perf_counter()
        for _ in range(sizes.delivery_events // CHUNK_EVENTS):
            for callback in callbacks:
                callback(prompt.batch)
        references.append(sizes.delivery_events / (time.perf_counter() - started))
    for unsubscribe in unsubscribes:
        unsubscribe()
    if any(c.events != 2 * sizes.rounds * sizes.delivery_events for c in callbacks):
        raise RuntimeError("events: a callback missed events")
    return {"events_per_s": statistics.median(rates), "reference_events_per_s": statistics.median(references)}


def topology(events: bool, capacity: int, endpoint: str | None) -> dict[str, Any]:
    """A GPU-only manager of ``capacity`` blocks; events published on ``endpoint`` (with a replay socket)."""
    return {
        "model": {"id": "scale-events"},
        "layout": LAYOUT,
        "tiers": [{"type": "gpu", "capacity_blocks": capacity, "options": {"device": "cpu"}}],
        "events": {"enabled": events, "endpoint": endpoint,
                   "replay_endpoint": "tcp://127.0.0.1:*" if events else None},
    }


class Storer:
    """One manager's stores of fresh prompts (each its own tokens)."""

    def __init__(self, manager: TierManager) -> None:
        self.manager, self.request = manager, 0

    def store(self) -> float:
        """Allocate, store (timed) and release one fresh prompt; µs of ``store``."""
        tokens = np.arange(BLOCKS_PER_STORE * BLOCK_SIZE) + self.request * BLOCKS_PER_STORE * BLOCK_SIZE
        self.request += 1
        ids = self.manager.allocate(BLOCKS_PER_STORE)
        started = time.perf_counter()
        self.manager.store(tokens, ids)
        elapsed = time.perf_counter() - started
        self.manager.release(ids)
        return elapsed * US_PER_SECOND

    def fill(self, blocks: int) -> None:
        """Store fresh prompts until at least ``blocks`` blocks are held."""
        while self.request * BLOCKS_PER_STORE < blocks:
            self.store()


def deque_us(prompt: Prompt, stores: int) -> float:
    """µs per store of the reference: a bare ``deque.append`` of the tuple the sink queues."""
    queue: deque[tuple[Any, ...]] = deque()
    started = time.perf_counter()
    for _ in range(stores):
        queue.append((TIER, prompt.keys, None, prompt.tokens, BLOCK_SIZE, None))
    return (time.perf_counter() - started) * US_PER_SECOND / stores


def store_costs(storers: dict[bool, Storer], stores: int) -> tuple[float, float]:
    """Median µs per block of ``store``, events off and on, the two managers taking turns."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    for index in range(stores):
        for events in (False, True) if index % 2 == 0 else (True, False):
            samples[events].append(storers[events].store())
    return statistics.median(samples[False]) / BLOCKS_PER_STORE, statistics.median(samples[True]) / BLOCKS_PER_STORE


def sweep(sizes: Sizes) -> list[dict[str, Any]]:
    """Every stage's row (the managers, sinks and subscriber processes live through all stages)."""
    prompt = Prompt()
    capacity = CAPACITY_MARGIN * (sizes.held[-1] + len(sizes.held) * sizes.timed_stores * BLOCKS_PER_STORE)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rows = []
    zmq_delivery = ZmqDelivery(prompt)
    callbacks = EventSink(EventsConfig(enabled=True))
    callbacks.start()
    off = TierManager(config_from_dict(topology(False, capacity, None), environ={}))
    on = TierManager(config_from_dict(topology(True, capacity, endpoint), environ={}))
    reader: Subscribers | None = None
    try:
        off.start_blocking()
        on.start_blocking()
        on_sink: EventSink = on.parts.events
        reader = Subscribers(1, [endpoint])
        reader.wait_ready(SINK_ID, lambda: mark(on_sink, MARK_READY, SINK_ID))
        storers = {False: Storer(off), True: Storer(on)}
        published = 0
        for blocks in sizes.held:
            for storer in storers.values():
                storer.fill(blocks)
            for sink in (zmq_delivery.sink, callbacks):  # their history: as many blocks' events published
                prompt.push(sink, (blocks - published) // BLOCKS_PER_STORE)
            published = blocks
            off_us, on_us = store_costs(storers, sizes.timed_stores)
            row: dict[str, Any] = {
                "blocks_held": blocks, "store_off_us_per_block": off_us, "store_on_us_per_block": on_us,
                "added_us_per_block": on_us - off_us,
                "deque_append_us_per_block": deque_us(prompt, sizes.timed_stores) / BLOCKS_PER_STORE,
            }
            for count in SUBSCRIBERS:
                for kind, figures in (("zmq", zmq_delivery.measure(count, sizes)),
                                      ("callback", callback_delivery(callbacks, count, prompt, sizes))):
                    row.update({f"{kind}_{count}_{name}": value for name, value in figures.items()})
            rows.append(row)
        mark(on_sink, MARK_END)
        rows[-1]["manager_store_events"] = storers[True].request  # one BlockStored per store of a fresh prompt
        rows[-1]["manager_subscriber_events"] = reader.results()[0]["events"]
    finally:
        if reader is not None:
            mark(on.parts.events, MARK_QUIT)
            reader.close()
        on.close_blocking()
        off.close_blocking()
        callbacks.close()
        zmq_delivery.close()
    return rows


DELIVERY = tuple((kind, count) for kind in ("zmq", "callback") for count in SUBSCRIBERS)
"""The delivery columns: ZeroMQ subscriber processes and in-process callbacks, 1 and 8 of each."""
GROWN = ("store_off_us_per_block", "store_on_us_per_block", *(f"{k}_{c}_events_per_s" for k, c in DELIVERY))


def run(quick: bool) -> dict[str, Any]:
    """The section: a row per stage, the growth of each figure, the load average at start and end."""
    load_start = os.getloadavg()
    started = time.perf_counter()
    sizes = QUICK if quick else FULL
    rows = sweep(sizes)
    return {
        "rows": rows,
        "growth": {name: rows[-1][name] / rows[0][name] for name in GROWN},
        "blocks_per_store": BLOCKS_PER_STORE, "chunk_events": CHUNK_EVENTS, "delivery_events": sizes.delivery_events,
        "timed_stores": sizes.timed_stores, "rounds": sizes.rounds,
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "runtime_s": time.perf_counter() - started,
    }


def table(section: dict[str, Any]) -> list[str]:
    """Markdown: per stage, the store's µs per block (off / on / added; a bare deque.append's), then events/s
    delivered through the sink (and the reference's) to 1 and 8 ZeroMQ subscribers and callbacks."""
    lines = ["| blocks held | store µs/block: off / on / added | deque.append µs/block | "
             + " | ".join(f"{kind} x{count} events/s (reference)" for kind, count in DELIVERY) + " |",
             "|---:|---:|---:|" + "---:|" * len(DELIVERY)]
    for row in section["rows"]:
        cells = [f"{row['blocks_held']:,}",
                 f"{row['store_off_us_per_block']:.2f} / {row['store_on_us_per_block']:.2f} / "
                 f"{row['added_us_per_block']:+.2f}",
                 f"{row['deque_append_us_per_block']:.4f}"]
        for kind, count in DELIVERY:
            lost = row.get(f"{kind}_{count}_lost", 0)
            rates = f"{row[f'{kind}_{count}_events_per_s']:,.0f} ({row[f'{kind}_{count}_reference_events_per_s']:,.0f})"
            cells.append(rates + (f", {lost} lost" if lost else ""))
        lines.append("| " + " | ".join(cells) + " |")
    growth = section["growth"]
    cells = [f"growth x{section['rows'][-1]['blocks_held'] // section['rows'][0]['blocks_held']}",
             f"{growth['store_off_us_per_block']:.2f}x / {growth['store_on_us_per_block']:.2f}x", "",
             *(f"{growth[f'{kind}_{count}_events_per_s']:.2f}x" for kind, count in DELIVERY)]
    lines.append("| " + " | ".join(cells) + " |")
    return lines
