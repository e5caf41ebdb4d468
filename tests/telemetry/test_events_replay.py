"""Replay requests against the ZeroMQ publisher: live batches keep going out, replays stay bounded and whole.

Issue 20 item 10: replays ran on the publishing thread, 64 full replays per wake-up, so 800 requests held
live batches back for seconds; the replay buffer was bounded in batches only. The clients here are real
ZeroMQ sockets on ``inproc://`` endpoints of the publisher's context: a pipe then holds only what the two
high-water marks allow (no kernel buffers), so a client that does not read stalls its replay at a known
point and the counts below are exact. Times are measured and printed, never asserted.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from tiercache.telemetry.events.config import EventsConfig
from tiercache.telemetry.events.replay import MAX_PENDING_REPLAYS, REPLAY_PIPE_HWM, REPLAYS_PER_CLIENT
from tiercache.telemetry.events.sink import EventSink

KEPT = 2 * REPLAY_PIPE_HWM
"""Batches published before the flood: a replay of them is longer than a non-reading client's pipe holds."""
FILL_TOKENS = 1600
"""Token ids per filling batch: about 5 KB of msgpack, the size the issue measured with."""
FLOOD = 800
LIVE = 20
"""Live batches the engine publishes while the flood is pending."""
DELIVERY_TIMEOUT_MS = 10_000
"""Generous bound for a message that was sent to arrive (a hang guard, never a speed threshold)."""
JOIN_ATTEMPTS = 100
JOIN_POLL_MS = 100
SETTLE_POLL_S = 0.01
"""Pause between looks at the publisher's counters while waiting for it to take in requests."""
ENDPOINTS = itertools.count()


def key(index: int) -> bytes:
    return hashlib.blake2b(index.to_bytes(8, "little"), digest_size=16).digest()


@pytest.fixture
def context() -> zmq.Context:
    return zmq.Context.instance()  # the publisher's: inproc endpoints live in one context


def publishing_sink(**options: object) -> EventSink:
    number = next(ENDPOINTS)
    config = EventsConfig(
        enabled=True,
        endpoint=f"inproc://test-events-{number}",
        replay_endpoint=f"inproc://test-replay-{number}",
        **{"replay_batches": 10 * KEPT, **options},
    )
    sink = EventSink.from_config(config)
    sink.start()
    return sink


@pytest.fixture
def sink() -> Iterator[EventSink]:
    sink = publishing_sink()
    yield sink
    sink.close()


def fill(sink: EventSink, batches: int) -> None:
    """Publish ``batches`` batches of about 5 KB, one flush each."""
    tokens = list(range(FILL_TOKENS))
    for index in range(batches):
        sink.stored("gpu", [key(index)], None, tokens, 1)
        assert sink.flush()


def subscriber(sink: EventSink, context: zmq.Context) -> tuple[zmq.Socket, int]:
    """A SUB socket whose subscription has provably arrived; returns it and the last seq it saw."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(sink._publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for attempt in range(JOIN_ATTEMPTS):
        sink.removed("join-marker", [key(attempt)])
        assert sink.flush()
        if sub.poll(JOIN_POLL_MS):
            newest = sink.stats()["published"] - 1
            while int.from_bytes(sub.recv_multipart()[1], "big") != newest:
                assert sub.poll(DELIVERY_TIMEOUT_MS)
            return sub, newest
    raise AssertionError("the subscriber never joined")


def dealer(sink: EventSink, context: zmq.Context) -> zmq.Socket:
    """A replay client whose own pipe holds one message: what it does not read stays on the server."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.connect(sink._publisher.replay_endpoint)
    return socket


def request(socket: zmq.Socket, start: int) -> None:
    socket.send_multipart((b"", start.to_bytes(8, "big")))


def answers(socket: zmq.Socket, count: int) -> list[list[int]]:
    """Read ``count`` answers: each the sequence numbers replayed before its end marker."""
    streams: list[list[int]] = [[]]
    while len(streams) <= count:
        assert socket.poll(DELIVERY_TIMEOUT_MS), f"answers stopped after {len(streams) - 1} of {count}"
        _, seq, payload = socket.recv_multipart()
        if payload:
            streams[-1].append(int.from_bytes(seq, "big"))
        else:
            assert int.from_bytes(seq, "big", signed=True) == -1
            streams.append([])
    return streams[:-1]


def wait_for(sink: EventSink, done: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """The publisher's counters once ``done`` holds for them (or the hang guard ran out)."""
    deadline = time.monotonic() + DELIVERY_TIMEOUT_MS / 1000
    while not done(stats := sink.stats()) and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
    return stats


def settled(sink: EventSink, requests: int) -> dict[str, int]:
    """The publisher's counters once it has taken in ``requests`` replay requests (admitted or refused)."""
    return wait_for(sink, lambda stats: stats["replay_requests"] + stats.get("replay_refused", 0) >= requests)


def test_a_replay_flood_never_holds_up_live_batches(sink: EventSink, context: zmq.Context) -> None:
    fill(sink, KEPT)
    sub, newest = subscriber(sink, context)
    flooder = dealer(sink, context)
    for _ in range(FLOOD):
        request(flooder, 0)

    stored_s, flush_s, live = [], [], []
    for index in range(LIVE):  # the engine goes on while the flood is taken in and served
        start = time.perf_counter()
        sink.stored("gpu", [key(KEPT + index)], None, [index], 1)
        stored_s.append(time.perf_counter() - start)
        assert sink.flush()
        flush_s.append(time.perf_counter() - start)
        assert sub.poll(DELIVERY_TIMEOUT_MS), "a live batch never arrived"
        live.append(int.from_bytes(sub.recv_multipart()[1], "big"))
    assert live == list(range(newest + 1, newest + 1 + LIVE))
    print(f"\nduring the flood: stored() max {max(stored_s) * 1e3:.3f} ms, flush max {max(flush_s) * 1e3:.1f} ms")
    stats = settled(sink, FLOOD)
    assert (stats["replay_requests"], stats.get("replay_refused")) == (REPLAYS_PER_CLIENT, FLOOD - REPLAYS_PER_CLIENT)
    assert stats.get("replays_pending") == REPLAYS_PER_CLIENT  # stalled on the client's full pipe

    streams = answers(flooder, FLOOD)  # every request answered, in the order asked
    full, refused = streams[:REPLAYS_PER_CLIENT], streams[REPLAYS_PER_CLIENT:]
    for stream in full:  # whole: every kept batch from 0 up to the newest at admission, in order
        assert stream == list(range(stream[-1] + 1)) and stream[-1] >= KEPT - 1
    assert refused == [[]] * (FLOOD - REPLAYS_PER_CLIENT)
    final = wait_for(sink, lambda stats: not stats["replays_pending"])  # counted done just after its last message
    assert (final["replays_pending"], final["replay_abandoned"]) == (0, 0)
    sub.close()
    flooder.close()


def test_replays_are_bounded_in_total_across_clients(sink: EventSink, context: zmq.Context) -> None:
    fill(sink, KEPT)
    clients = [dealer(sink, context) for _ in range(MAX_PENDING_REPLAYS + 8)]
    for client in clients:
        request(client, 0)
    stats = settled(sink, len(clients))
    assert (stats["replay_requests"], stats.get("replay_refused")) == (MAX_PENDING_REPLAYS, 8)
    streams = [answers(client, 1)[0] for client in clients]
    assert sum(not stream for stream in streams) == 8
    assert all(stream == list(range(KEPT)) for stream in streams if stream)
    for client in clients:
        client.close()


def test_the_replay_buffer_is_bounded_in_bytes(context: zmq.Context) -> None:
    sink = publishing_sink(replay_bytes=20 * 5000)
    try:
        fill(sink, 60)
        stats = sink.stats()
        assert stats["replay_buffered_bytes"] <= 20 * 5000 and stats["replay_buffered"] < 60
        client = dealer(sink, context)
        request(client, 0)
        (stream,) = answers(client, 1)
        assert stream == list(range(60 - stats["replay_buffered"], 60))  # the newest kept, whole and in order
        client.close()
    finally:
        sink.close()


def test_a_client_gone_mid_replay_is_forgotten(sink: EventSink, context: zmq.Context) -> None:
    fill(sink, KEPT)
    leaving, staying = dealer(sink, context), dealer(sink, context)
    request(leaving, 0)
    assert settled(sink, 1)["replays_pending"] == 1  # stalled on its full pipe
    leaving.close()
    request(staying, KEPT - 3)
    assert answers(staying, 1) == [[KEPT - 3, KEPT - 2, KEPT - 1]]
    final = wait_for(sink, lambda stats: (stats["replay_abandoned"], stats["replays_pending"]) == (1, 0))
    assert (final["replay_abandoned"], final["replays_pending"]) == (1, 0)
    staying.close()
