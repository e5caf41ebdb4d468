"""ZeroMQ publisher of KV event batches with replay, speaking vLLM's ZmqEventPublisher protocol.

PUB socket: each batch is one multipart message ``(topic, seq, payload)``: the
configured topic, the batch's sequence number (8 bytes, big-endian, from 0) and
the msgpack of the ``KVEventBatch`` (in the configured ``EventWire`` form). The last ``replay_batches`` payloads are
kept; a client that sees a gap in the sequence numbers sends the first missing
one (8 bytes, big-endian) to the ROUTER replay socket, which answers with
``(seq, payload)`` for every kept batch from there on, then ``(-1, b"")`` as the
end marker. A DEALER client receives all of them; a REQ client (as in vLLM's
example subscriber) receives only the first, so it asks once per missing batch.

The sockets are created by the constructor (so a bad or busy address fails
there) and afterwards used only by the event sink's background thread
(``publish`` and ``serve``); ``close`` runs after that thread has stopped.
"""

from __future__ import annotations

import logging
from collections import deque
from itertools import count

import msgspec
import zmq

from tiercache.events.config import EventsConfig
from tiercache.events.wire import KVEventBatch, MapKVEventBatch

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
"""Sequence numbers are 8-byte big-endian integers, on both sockets."""
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""Sequence number of the empty message that ends a replay."""
REPLAY_REQUEST_FRAMES = 3
"""A replay request on the ROUTER: client identity, empty delimiter, start sequence."""
MAX_REPLAY_REQUESTS_PER_SERVE = 64
"""Replay requests answered per wake-up, so a flood of them cannot starve publishing."""


class ZmqEventPublisher:
    """PUB socket for batches, ROUTER socket for replays, a bounded buffer of recent payloads."""

    def __init__(self, config: EventsConfig, context: zmq.Context | None = None) -> None:
        if config.endpoint is None:
            raise ValueError("endpoint: the ZeroMQ publisher needs an address")
        self.config = config
        self._context = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self.published = 0
        self.replay_requests = 0
        self.invalid_replay_requests = 0
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        """The address the PUB socket is bound to (the port filled in when the config said ``*``)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        """The address the replay socket is bound to, if there is one."""
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, batch: KVEventBatch | MapKVEventBatch) -> None:
        """Send one batch (in its wire form: the sink converts) with the next sequence number and keep it for
        replay (never blocks: PUB drops)."""
        seq = next(self._sequence)
        payload = self._encoder.encode(batch)
        self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1

    def serve(self) -> None:
        """Answer the replay requests waiting on the ROUTER socket (a bounded number per call)."""
        if self._replay is None:
            return
        for _ in range(MAX_REPLAY_REQUESTS_PER_SERVE):
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer(frames)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != REPLAY_REQUEST_FRAMES or len(frames[2]) != SEQ_BYTES:
            self.invalid_replay_requests += 1
            logger.warning("events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, delimiter, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self.replay_requests += 1
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, delimiter, seq.to_bytes(SEQ_BYTES, "big"), payload))
        self._replay.send_multipart((client, delimiter, END_OF_REPLAY, b""))

    def close(self) -> None:
        """Close both sockets now (LINGER 0: nothing is waited for)."""
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def stats(self) -> dict[str, int]:
        """Batches published and replay requests served or refused."""
        return {
            "published": self.published,
            "replay_requests": self.replay_requests,
            "invalid_replay_requests": self.invalid_replay_requests,
            "replay_buffered": len(self._buffer),
        }
