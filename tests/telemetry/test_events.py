"""KV events: a real ZeroMQ subscriber on loopback decodes them with vLLM's own message definitions.

What is tiercache's own (the sink, the publisher, replay) is read back with tiercache's own wire
module. Only the checks of the wire format itself decode with vLLM's declarations
(``support.vllm_kv_events``) and a block-hash mapping written out here: there the independence
from ``tiercache.telemetry.events.wire`` is the point.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder
from support.vllm_kv_events import (
    DELIVERY_TIMEOUT_MS,
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExampleKVEventBatch,
    KVEventBatch,
    NewerAllBlocksCleared,
    NewerBlockRemoved,
    NewerBlockStored,
    NewerKVEventBatch,
    joined_subscriber,
    keys,
    receive,
)

from tiercache.telemetry.events import wire
from tiercache.telemetry.events.config import EventsConfig, EventWire
from tiercache.telemetry.events.sink import EventSink
from tiercache.telemetry.events.wire import block_hash

BLOCK_SIZE = 4

# --- helpers -----------------------------------------------------------------------------------


def reference_hash(key: bytes) -> int:
    """The mapping written out independently: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(key[8:16], byteorder="big", signed=False)


def started_sink(wire: EventWire = EventWire.ARRAY) -> EventSink:
    config = EventsConfig(
        enabled=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic=TOPIC,
        wire=wire,
        data_parallel_rank=0,
    )
    sink = EventSink.from_config(config)
    sink.start()
    return sink


@pytest.fixture
def sink() -> Any:
    sink = started_sink()
    yield sink
    sink.close()


@pytest.fixture
def context() -> Any:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# --- tests -------------------------------------------------------------------------------------


def test_block_hash_is_the_last_eight_bytes_big_endian() -> None:
    key = bytes(range(16))
    assert block_hash(key) == 0x08090A0B0C0D0E0F
    assert all(block_hash(k) == reference_hash(k) for k in keys(50))


def test_vllm_subscriber_decodes_every_event_kind(sink: EventSink, context: zmq.Context) -> None:
    sub, last_seq = joined_subscriber(sink, context)
    gpu_keys, cpu_keys = keys(3, salt=1), keys(2, salt=2)
    tokens = list(range(3 * BLOCK_SIZE))
    sink.stored("gpu", gpu_keys, None, tokens, BLOCK_SIZE)
    sink.stored("cpu", cpu_keys, gpu_keys[-1], tokens[: 2 * BLOCK_SIZE], BLOCK_SIZE, lora_id=7)
    sink.removed("gpu", gpu_keys[1:])
    sink.cleared()
    assert sink.flush()

    topic, seq, payload = receive(sub)
    assert topic == TOPIC.encode()
    assert seq == last_seq + 1
    batch = Decoder(type=KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        BlockStored([reference_hash(k) for k in gpu_keys], None, tokens, BLOCK_SIZE, None, "gpu"),
        BlockStored(
            [reference_hash(k) for k in cpu_keys],
            reference_hash(gpu_keys[-1]),
            tokens[: 2 * BLOCK_SIZE],
            BLOCK_SIZE,
            7,
            "cpu",
        ),
        BlockRemoved([reference_hash(k) for k in gpu_keys[1:]], "gpu"),
        AllBlocksCleared(),
    ]
    # The example subscriber's batch (no rank field) reads the same message: the trailing rank is skipped.
    assert Decoder(type=ExampleKVEventBatch).decode(payload).events == batch.events
    # On the wire: positional arrays with the class name as tag, as vLLM sends them.
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][2] == ["BlockRemoved", [reference_hash(k) for k in gpu_keys[1:]], "gpu"]
    assert raw[1][3] == ["AllBlocksCleared"]
    assert raw[2] == 0


def test_newer_vllm_subscriber_decodes_the_map_wire(context: zmq.Context) -> None:
    sink = started_sink(EventWire.MAP)
    try:
        sub, _ = joined_subscriber(sink, context)
        stored = keys(2, salt=3)
        sink.stored("cpu", stored, None, list(range(2 * BLOCK_SIZE)), BLOCK_SIZE, lora_id=1)
        sink.removed("cpu", stored[1:])
        sink.cleared()
        assert sink.flush()
        _, _, payload = receive(sub)
    finally:
        sink.close()
    batch = Decoder(type=NewerKVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        NewerBlockStored(
            [reference_hash(k) for k in stored], None, list(range(2 * BLOCK_SIZE)), BLOCK_SIZE, 1, "cpu", None
        ),
        NewerBlockRemoved([reference_hash(stored[1])], "cpu"),
        NewerAllBlocksCleared(),
    ]
    assert msgspec.msgpack.decode(payload)["events"][1] == {
        "type": "BlockRemoved",
        "block_hashes": [reference_hash(stored[1])],
        "medium": "cpu",
    }


def test_a_gap_is_replayed_from_the_replay_socket(sink: EventSink, context: zmq.Context) -> None:
    sub, last_seq = joined_subscriber(sink, context)
    decoder = Decoder(type=wire.KVEventBatch)  # replay is tiercache's: read back with its own wire module
    published = {}
    for i in range(6):
        sink.stored("gpu", keys(1, salt=10 + i), None, list(range(BLOCK_SIZE)), BLOCK_SIZE)
        assert sink.flush()
        _, seq, payload = receive(sub)
        published[seq] = decoder.decode(payload)
    sequence = sorted(published)
    assert sequence == list(range(last_seq + 1, last_seq + 7))
    lost = sequence[1:4]  # the subscriber "missed" these three
    seen_last, current = sequence[0], sequence[4]
    assert current > seen_last + 1

    # vLLM's example subscriber: a REQ socket sends the first missing seq and gets back the first
    # batch from there. A REQ takes one reply per request and the rest of the stream stays in its
    # pipe, where a later request on the same socket may take a stale one as its answer (the
    # protocol's, and the example's, limit): so one fresh REQ socket per missing batch.
    recovered = []
    next_seq = seen_last + 1
    while next_seq < current:
        req = context.socket(zmq.REQ)
        req.connect(sink._publisher.replay_endpoint)
        req.send(next_seq.to_bytes(8, "big"))
        assert req.poll(DELIVERY_TIMEOUT_MS), "no replay answer"
        seq_bytes, payload = req.recv_multipart()
        req.close(linger=0)
        assert payload, "the replay buffer lost batches it should keep"
        recovered.append(int.from_bytes(seq_bytes, "big"))
        assert decoder.decode(payload) == published[recovered[-1]]
        next_seq = recovered[-1] + 1
    assert recovered == lost

    # A DEALER gets the whole stream for one request, then the end marker (seq -1, empty payload).
    dealer = context.socket(zmq.DEALER)
    dealer.connect(sink._publisher.replay_endpoint)
    dealer.send_multipart((b"", lost[0].to_bytes(8, "big")))
    streamed = []
    while True:
        assert dealer.poll(DELIVERY_TIMEOUT_MS), "replay stream stopped before its end marker"
        _, seq_bytes, payload = dealer.recv_multipart()
        if not payload:
            assert int.from_bytes(seq_bytes, "big", signed=True) == -1
            break
        streamed.append(int.from_bytes(seq_bytes, "big"))
    assert streamed == sequence[1:]
    assert sink.stats()["replay_requests"] == len(lost) + 1


def test_bounded_queue_drops_and_counts() -> None:
    sink = EventSink(EventsConfig(enabled=True, max_queue=3))
    batches = []
    sink.subscribe(batches.append)
    for i in range(5):  # not started yet: nothing drains the queue
        sink.removed("gpu", keys(1, salt=i))
    assert sink.stats()["dropped"] == 2
    sink.start()
    assert sink.flush()
    sink.close()
    assert [len(b.events) for b in batches] == [3]
    assert sink.stats() | {"queued": 0} == {
        "queued": 0,
        "dropped": 2,
        "batches": 1,
        "events": 3,
        "callback_errors": 0,
        "publish_errors": 0,
    }


def test_a_failing_subscriber_is_logged_and_counted_and_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    sink = EventSink(EventsConfig(enabled=True))
    threads = []
    received = []

    def broken(batch: Any) -> None:
        raise RuntimeError("subscriber bug")

    def good(batch: Any) -> None:
        threads.append(threading.current_thread())
        received.append(batch)

    sink.subscribe(broken)
    unsubscribe = sink.subscribe(good)
    sink.start()
    with caplog.at_level(logging.ERROR, logger="tiercache.telemetry.events.sink"):
        sink.cleared("cpu")
        assert sink.flush()
    unsubscribe()
    sink.removed("gpu", keys(1))
    assert sink.flush()
    sink.close()
    assert len(received) == 1
    assert threads == [sink._thread] and sink._thread is not threading.current_thread()
    assert sink.stats()["callback_errors"] == 2
    assert "subscriber bug" in caplog.text


def test_a_stuck_subscriber_never_blocks_the_engine_thread() -> None:
    """A callback that never returns holds the background thread: engine calls still return, drops counted."""
    sink = EventSink(EventsConfig(enabled=True, max_queue=4))
    entered, release = threading.Event(), threading.Event()

    def stuck(batch: Any) -> None:
        entered.set()
        release.wait()

    sink.subscribe(stuck)
    sink.start()
    sink.removed("gpu", keys(1))
    assert entered.wait(DELIVERY_TIMEOUT_MS / 1000)  # the background thread is now stuck in the callback
    for i in range(10):  # each call returns at once although nothing drains the queue
        sink.removed("gpu", keys(1, salt=i))
    assert sink.stats()["dropped"] == 6
    release.set()
    assert sink.flush()
    sink.close()
    assert sink.stats()["events"] == 5


def test_a_copy_moved_by_key_carries_the_parent_and_tokens_first_stored() -> None:
    sink = EventSink(EventsConfig(enabled=True, lineage_blocks=3))
    batches: list[Any] = []
    sink.subscribe(batches.append)
    chain = keys(4, salt=20)
    tokens = list(range(4 * BLOCK_SIZE))
    sink.stored("gpu", chain, None, tokens, BLOCK_SIZE)  # the last 3 blocks are remembered
    sink.stored("cpu", chain[2:], None, None, BLOCK_SIZE)  # demoted by key alone
    sink.stored("cpu", chain[:2], None, None, BLOCK_SIZE)  # the first block was forgotten: no tokens
    sink.start()
    assert sink.flush()
    sink.close()
    _, demoted, remembered, forgotten = batches[0].events
    assert demoted.parent_block_hash == block_hash(chain[1])
    assert demoted.token_ids == tokens[2 * BLOCK_SIZE :]
    assert remembered.block_hashes == [block_hash(chain[1])] and remembered.parent_block_hash == block_hash(chain[0])
    assert remembered.token_ids == tokens[BLOCK_SIZE : 2 * BLOCK_SIZE]
    assert forgotten.block_hashes == [block_hash(chain[0])]
    assert (forgotten.parent_block_hash, forgotten.token_ids) == (None, [])


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_queue": 0}, "max_queue"),
        ({"lineage_blocks": -1}, "lineage_blocks"),
        ({"flush_interval_s": 0.0}, "flush_interval_s"),
        ({"endpoint": "localhost:5557"}, "endpoint"),
        ({"replay_endpoint": "tcp://*:5558"}, "replay_endpoint"),
    ],
)
def test_bad_settings_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EventsConfig(**options)


def test_a_busy_address_fails_at_construction(sink: EventSink) -> None:
    with pytest.raises(zmq.ZMQError):
        EventSink.from_config(EventsConfig(enabled=True, endpoint=sink._publisher.endpoint))


def test_copies_moved_by_key_are_told_one_chain_at_a_time_head_first() -> None:
    """A demotion hands over blocks tail first and several chains mixed: each chain becomes one event, head first."""
    sink = EventSink(EventsConfig(enabled=True, lineage_blocks=64))
    batches: list[Any] = []
    sink.subscribe(batches.append)
    first, second = keys(4, salt=30), keys(3, salt=31)
    first_tokens, second_tokens = list(range(4 * BLOCK_SIZE)), list(range(100, 100 + 3 * BLOCK_SIZE))
    sink.stored("gpu", first, None, first_tokens, BLOCK_SIZE)
    sink.stored("gpu", second, first[1], second_tokens, BLOCK_SIZE)  # branches off the first chain's block 1
    stranger = keys(1, salt=32)  # never computed here: no lineage
    demotion = [first[3], second[2], first[2], *stranger, second[1], first[1], second[0]]
    sink.stored("cpu", demotion, None, None, BLOCK_SIZE)
    sink.start()
    assert sink.flush()
    sink.close()
    demoted = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in batches[0].events if e.medium == "cpu"]
    hashes = [block_hash(key) for key in first + second]
    assert demoted == [
        (hashes[1:4], hashes[0], first_tokens[BLOCK_SIZE:]),
        (hashes[4:7], hashes[1], second_tokens),
        ([block_hash(stranger[0])], None, []),
    ]
