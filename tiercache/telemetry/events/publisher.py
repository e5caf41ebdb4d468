"""ZeroMQ publisher of KV event batches with replay, speaking vLLM's ZmqEventPublisher protocol.

PUB socket: each batch is one multipart message ``(topic, seq, payload)``: the
configured topic, the batch's sequence number (8 bytes, big-endian, from 0) and
the msgpack of the ``KVEventBatch`` (in the configured ``EventWire`` form). The
newest payloads are kept for replay, at most ``replay_batches`` of them and
``replay_bytes`` in all; a client that sees a gap in the sequence numbers sends
the first missing one (8 bytes, big-endian) to the ROUTER replay socket, which
answers with ``(seq, payload)`` for every kept batch from there on, then
``(-1, b"")`` as the end marker. A DEALER client receives all of them; a REQ
client (as in vLLM's example subscriber) receives only the first, so it asks
once per missing batch. Replays are served by their own thread, bounded per
client and in total (``tiercache.telemetry.events.replay``), so a flood of requests never
holds up live batches.

The sockets are created by the constructor (so a bad or busy address fails
there). The PUB socket is afterwards used only by the event sink's background
thread (``publish``), the ROUTER socket only by the replay thread; ``close``
runs after the sink's thread has stopped, and stops the replay thread.
"""

from __future__ import annotations

from itertools import count

import msgspec
import zmq

from tiercache.telemetry.events.config import EventsConfig
from tiercache.telemetry.events.replay import SEQ_BYTES, ReplayBuffer, ReplayServer, bind_replay_socket
from tiercache.telemetry.events.wire import KVEventBatch, MapKVEventBatch


class ZmqEventPublisher:
    """PUB socket for batches; a replay buffer bounded in batches and bytes, served by its own thread."""

    def __init__(self, config: EventsConfig, context: zmq.Context | None = None) -> None:
        if config.endpoint is None:
            raise ValueError("endpoint: the ZeroMQ publisher needs an address")
        self.config = config
        self._context = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = count()
        self._buffer = ReplayBuffer(config.replay_batches, config.replay_bytes)
        self.published = 0
        self._pub = self._context.socket(zmq.PUB)
        self._replay: ReplayServer | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(config.endpoint)
            replay_socket = None
            if config.replay_endpoint is not None:
                replay_socket = bind_replay_socket(self._context, config.replay_endpoint)
        except zmq.ZMQError:
            self._pub.close()
            raise
        if replay_socket is not None:
            self._replay_endpoint = replay_socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = ReplayServer(replay_socket, self._buffer)

    @property
    def endpoint(self) -> str:
        """The address the PUB socket is bound to (the port filled in when the config said ``*``)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        """The address the replay socket is bound to, if there is one."""
        return None if self._replay is None else self._replay_endpoint

    def publish(self, batch: KVEventBatch | MapKVEventBatch) -> None:
        """Send one batch (in its wire form: the sink converts) with the next sequence number and keep it for
        replay (never blocks: PUB drops)."""
        seq = next(self._sequence)
        payload = self._encoder.encode(batch)
        self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload), flags=zmq.NOBLOCK)
        self._buffer.append(seq, payload)
        self.published += 1

    def close(self) -> None:
        """Stop the replay thread and close both sockets (LINGER 0: nothing is waited for)."""
        if self._replay is not None:
            self._replay.close()
        self._pub.close()

    def stats(self) -> dict[str, int]:
        """Batches published and kept for replay; replay requests served, refused and abandoned."""
        batches, payload_bytes = self._buffer.stats()
        counters = {"published": self.published, "replay_buffered": batches, "replay_buffered_bytes": payload_bytes}
        if self._replay is not None:
            counters.update(self._replay.stats())
        return counters
