"""Replay of published KV event batches: a buffer bounded in batches and bytes, served on its own thread.

The publisher appends every batch it sends to a ``ReplayBuffer``. A ``ReplayServer`` owns the ROUTER
socket and a thread of its own, so however many replay requests arrive, live batches keep going out on
the publisher's thread. A request (the first missing sequence number) is answered with
``(seq, payload)`` for every batch kept from there up to the newest kept when it was admitted, then
``(-1, b"")``. Replays are bounded: at most ``REPLAYS_PER_CLIENT`` pending per client and
``MAX_PENDING_REPLAYS`` in all; a request beyond either is refused and counted, and answered, in its
turn, with the end marker alone (as if nothing were kept from there). Clients take turns, each sent up
to ``REPLAY_CHUNK`` messages per turn without blocking: a client that does not read fills its pipe
(``REPLAY_PIPE_HWM`` messages) and is skipped until it drains, or forgotten after ``STALLED_REPLAY_S``
without progress; a client that disconnected is forgotten at once. A replay that falls behind the
buffer's eviction skips to the oldest batch still kept (the client sees the gap in the sequence numbers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
"""Sequence numbers are 8-byte big-endian integers, on both sockets."""
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""Sequence number of the empty message that ends a replay."""
REPLAY_REQUEST_FRAMES = 3
"""A replay request on the ROUTER: client identity, empty delimiter, start sequence."""
REPLAYS_PER_CLIENT = 4
"""Replays pending for one client (one connection) at a time; its further requests are refused."""
MAX_PENDING_REPLAYS = 32
"""Replays pending in all; further requests are refused."""
REPLAY_CHUNK = 64
"""Messages one client is sent per turn before the next client's turn."""
REQUESTS_PER_TURN = 256
"""Requests read from the socket per turn, so a flood of them cannot starve the replays under way."""
REPLAY_PIPE_HWM = 256
"""Messages queued towards one replay client (ZeroMQ's high-water mark) before its replay pauses."""
TURN_PAUSE_S = 0.0005
"""Pause after a turn that sent something: the thread lets go of the GIL, so the engine's thread and the
live publisher get it at once instead of after Python's switch interval (5 ms)."""
POLL_MS = 50
"""Longest the thread sleeps when idle (also how soon ``close`` is noticed)."""
BLOCKED_POLL_MS = 5
"""How long the thread waits when every pending replay's client has a full pipe."""
STALLED_REPLAY_S = 30.0
"""A client that has read nothing for this long is forgotten (its replays counted ``replay_abandoned``)."""
CLOSE_TIMEOUT_S = 2.0
"""Longest ``close`` waits for the thread."""


class ReplayBuffer:
    """The newest published batches, at most ``max_batches`` and ``max_bytes`` of payload (thread-safe)."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._items: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        """Keep batch ``seq`` (one more than the last), evicting the oldest past either bound."""
        with self._lock:
            self._items.append((seq, payload))
            self._bytes += len(payload)
            while len(self._items) > self.max_batches or (self._bytes > self.max_bytes and len(self._items) > 1):
                self._bytes -= len(self._items.popleft()[1])

    def newest(self) -> int:
        """The newest kept sequence number (-1 if none)."""
        with self._lock:
            return self._items[-1][0] if self._items else -1

    def since(self, start: int, stop: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` kept batches with ``start <= seq <= stop``, oldest first."""
        with self._lock:
            if not self._items:
                return []
            first = self._items[0][0]
            begin = max(0, start - first)
            end = min(len(self._items), stop - first + 1, begin + limit)
            return [self._items[index] for index in range(begin, end)]

    def stats(self) -> tuple[int, int]:
        """(batches, bytes) kept."""
        with self._lock:
            return len(self._items), self._bytes


@dataclass
class _Replay:
    """An admitted request: the kept batches still to send its client, then the end marker."""

    delimiter: bytes
    next_seq: int
    stop_seq: int


@dataclass
class _Ends:
    """Refused requests still to answer (each with the end marker alone), in their turn among the replays."""

    delimiter: bytes
    count: int = 1


@dataclass
class _Client:
    """What one client (one connection) is owed, in the order it asked: replays and refusals."""

    owed: deque[_Replay | _Ends] = field(default_factory=deque)
    replays: int = 0
    progress_at: float = field(default_factory=time.monotonic)


def bind_replay_socket(context: zmq.Context, endpoint: str) -> zmq.Socket:
    """The ROUTER socket, bound (a bad or busy address fails here): a full pipe to a client says EAGAIN
    and a client that is gone says EHOSTUNREACH, instead of ZeroMQ dropping what is sent to them."""
    socket = context.socket(zmq.ROUTER)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, REPLAY_PIPE_HWM)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.bind(endpoint)
    except zmq.ZMQError:
        socket.close(linger=0)
        raise
    return socket


class ReplayServer:
    """The ROUTER socket's thread: reads requests, admits or refuses them, answers them in turns.

    Each client is answered in the order it asked (a DEALER matches answers to requests by order alone):
    a refused request's end marker waits behind the replays the client asked for before it.
    """

    def __init__(self, socket: zmq.Socket, buffer: ReplayBuffer) -> None:
        self._socket = socket
        self._buffer = buffer
        self._clients: dict[bytes, _Client] = {}
        self._pending = 0
        self._stop = threading.Event()
        self.requests = 0
        self.refused = 0
        self.abandoned = 0
        self.invalid = 0
        self._thread = threading.Thread(target=self._run, name="tiercache-events-replay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (bounded wait), then close the socket."""
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("events: replay thread still running after %.1f s; abandoning it", CLOSE_TIMEOUT_S)
            return
        self._socket.close(linger=0)

    def stats(self) -> dict[str, int]:
        """Replay requests admitted, refused, abandoned and malformed; replays pending."""
        return {
            "replay_requests": self.requests,
            "replay_refused": self.refused,
            "replay_abandoned": self.abandoned,
            "invalid_replay_requests": self.invalid,
            "replays_pending": self._pending,
        }

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        timeout = POLL_MS
        while not self._stop.is_set():
            try:
                if poller.poll(timeout):
                    self._read_requests()
                sent = self._turn()
            except Exception:  # never let the thread die: log, go on
                logger.exception("events: serving replays failed")
                sent = False
            if sent:
                time.sleep(TURN_PAUSE_S)
            timeout = 0 if sent else (BLOCKED_POLL_MS if self._clients else POLL_MS)

    def _read_requests(self) -> None:
        for _ in range(REQUESTS_PER_TURN):
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != REPLAY_REQUEST_FRAMES or len(frames[2]) != SEQ_BYTES:
                self.invalid += 1
                if self.invalid == 1:
                    logger.warning("events: ignoring a malformed replay request (%d frames; logged once)", len(frames))
                continue
            client_id, delimiter, start = frames
            client = self._clients.setdefault(client_id, _Client())
            if client.replays >= REPLAYS_PER_CLIENT or self._pending >= MAX_PENDING_REPLAYS:
                self.refused += 1
                last = client.owed[-1] if client.owed else None
                if isinstance(last, _Ends):
                    last.count += 1
                else:
                    client.owed.append(_Ends(delimiter))
            else:
                self.requests += 1
                client.owed.append(_Replay(delimiter, int.from_bytes(start, "big"), self._buffer.newest()))
                client.replays += 1
                self._pending += 1

    def _turn(self) -> bool:
        """Each client gets up to a chunk of what it is owed; True if anything was sent."""
        sent_any = False
        now = time.monotonic()
        for client_id, client in list(self._clients.items()):
            sent, gone = self._answer(client_id, client)
            if sent:
                sent_any = True
                client.progress_at = now
            if gone or now - client.progress_at > STALLED_REPLAY_S:
                self._forget(client_id, client)
            elif not client.owed:
                del self._clients[client_id]
        return sent_any

    def _answer(self, client_id: bytes, client: _Client) -> tuple[int, bool]:
        """Send the head of what ``client`` is owed, up to a chunk: (messages sent, whether it is gone)."""
        head = client.owed[0]
        if isinstance(head, _Ends):
            messages = [(head.delimiter, END_OF_REPLAY, b"")] * min(head.count, REPLAY_CHUNK)
        else:
            chunk = self._buffer.since(head.next_seq, head.stop_seq, REPLAY_CHUNK)
            messages = [(head.delimiter, seq.to_bytes(SEQ_BYTES, "big"), payload) for seq, payload in chunk]
            if not chunk or chunk[-1][0] >= head.stop_seq:
                messages.append((head.delimiter, END_OF_REPLAY, b""))
        sent = 0
        for message in messages:
            outcome = self._send(client_id, message)
            if outcome is None:
                return sent, True
            if not outcome:
                break
            sent += 1
        if not sent:
            return 0, False
        if isinstance(head, _Ends):
            head.count -= sent
            finished = head.count == 0
        else:
            finished = messages[sent - 1][1] == END_OF_REPLAY
            if finished:
                client.replays -= 1
                self._pending -= 1
            else:
                head.next_seq = chunk[sent - 1][0] + 1
        if finished:
            client.owed.popleft()
        return sent, False

    def _forget(self, client_id: bytes, client: _Client) -> None:
        """Drop everything owed to a client that is gone or has read nothing for too long."""
        del self._clients[client_id]
        self._pending -= client.replays
        self.abandoned += client.replays

    def _send(self, client_id: bytes, message: tuple[bytes, bytes, bytes]) -> bool | None:
        """Send without blocking: True if sent, False if the client's pipe is full, None if it is gone."""
        try:
            self._socket.send_multipart((client_id, *message), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                return None
            raise
