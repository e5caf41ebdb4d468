"""One connection's long-lived I/O thread: jobs in through a queue, requests pipelined continuously.

Why a thread per connection, not a pool. A worker handed one batch at a time
leaves the server idle at every batch boundary (the hand-off from the event loop
and back costs more than the server needs per value). A lane instead keeps
sending: while it reads the replies of one job it sends the requests of the next
one queued, up to ``window`` requests in flight, topped up whenever a job's send
group fits again (half a window for reads; small groups for writes, so that the
server starts storing the first values while the next ones are checksummed). The
window is sized for values; a job of small requests (a presence check's EXISTS)
has a window of its own (``RedisJob.window``), so that asking about a prompt's
blocks is one round trip, not one per half a window of values.
Coroutines hand jobs over with ``PipelinedConnection.submit`` and await a future that the
thread completes with ``call_soon_threadsafe``; the event loop never blocks.

A connection that breaks under traffic (reset, closed, garbage) is dropped and
replaced, and what it had not answered is sent again on the fresh one: requests
are GET, SET of a whole value, EXISTS, UNLINK or control commands, all safe to
repeat, and a reply stream is never read past a point where it was lost. Only a
server that gives no working connection (refused, silent past the socket timeout,
or several fresh connections broken before any reply) fails the jobs, each counting
its unread keys under the failure's kind; the next job reconnects.
Nothing raised in the thread reaches the event loop: unexpected exceptions are
logged and counted as ``internal``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable

from tiercache.tiers.redis.resp import Connection, ConnectionFailed

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
"""``close`` waits at most this long for the thread (it is a daemon: it never holds up exit)."""
_STOP = object()
"""Queued by ``close``: the thread fails what is left and exits."""
BROKEN_KINDS = frozenset({"connection", "protocol"})
"""Failures of an open connection (reset or closed, a reply stream lost track of): the connection is
replaced and what it had not answered is sent again. A timeout is not one of them: a server silent
past the socket timeout is failing (asking it again on a fresh connection would double the wait)."""
MAX_QUIET_BREAKS = 3
"""Fresh connections that may break in a row before any reply; one more fails the jobs (the server,
not a connection, is failing)."""


class RedisJob:
    """A batch of requests for one connection and the reading of their replies.

    Subclasses say what to send (``requests``) and how to read a reply
    (``read_reply``); the lane does the rest. Outcomes are counted per key in
    ``outcomes``; on a failure the keys not yet answered are counted under the
    failure's kind and ``failure`` names it.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.sent = 0
        self.read = 0
        self.outcomes: Counter = Counter()
        self.failure: str | None = None
        self.error: str | None = None
        """The last error seen: the failure's cause, or an error reply (``NOPERM ...``)."""
        self.cancelled = False
        """Set from the event loop: read what was sent without touching the caller's buffers, send no more."""
        self.on_wire = False
        """In the thread: requests of this job await replies on the current connection."""
        self.future: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def window(self, values_window: int) -> int:
        """Requests of this job in flight at most, given the connection's window for value-sized requests."""
        return values_window

    def send_group(self, window: int) -> int:
        """Requests per send: half the window (a reply stream the server never waits on)."""
        return max(1, window // 2)

    def finish(self) -> None:
        """In the thread, once the job is answered or failed, before its future resolves."""

    def begin(self, conn: Connection) -> bool:
        """Before the first request is sent; False: nothing to send (outcomes already counted)."""
        return True

    def requests(self, start: int, stop: int) -> list[bytes | memoryview]:
        """The encoded requests ``start..stop-1``, as buffers to send back to back."""
        raise NotImplementedError

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        """Read the reply to request ``index`` (``pending_after`` more replies are on their way)."""
        raise NotImplementedError

    def read_replies(self, conn: Connection, count: int, pending_after: int) -> None:
        """Read the next ``count`` replies (``pending_after`` more follow the last), advancing ``read``
        with each one, so that a failure midway counts only the unread; a cancelled job's replies
        are read and dropped."""
        for left in range(count - 1, -1, -1):
            if self.cancelled:
                self.discard_reply(conn)
            else:
                self.read_reply(conn, self.read, pending_after + left)
            self.read += 1

    def discard_reply(self, conn: Connection) -> None:
        """Read and drop one reply (the job was cancelled)."""
        conn.read_reply()

    @property
    def done(self) -> bool:
        """Every request that will be sent is sent and answered."""
        return self.read == self.sent and (self.sent == self.count or self.cancelled)


def _resolve(future: asyncio.Future, job: RedisJob) -> None:
    if not future.done():
        future.set_result(job)


def failure_kind(error: BaseException) -> str:
    """The outcome name of an exception raised while talking to a server."""
    if isinstance(error, ConnectionFailed):
        return error.kind
    if isinstance(error, (TimeoutError, BlockingIOError)):
        return "timeout"
    if isinstance(error, OSError):
        return "connection"
    logger.error("redis tier: unexpected error in an I/O thread", exc_info=error)
    return "internal"


class PipelinedConnection:
    """A connection (opened on demand by ``opener``) and the thread that drives it."""

    def __init__(self, name: str, opener: Callable[[], Connection], window: int) -> None:
        self.name = name
        self.window = window
        self._opener = opener
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._on_stop: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        """Set by ``close`` before it queues the stop: the future the thread resolves on exit."""
        self._conn: Connection | None = None
        self.connects = 0
        self.replaced = 0
        """Connections that broke under traffic and were replaced (their jobs sent again)."""
        self._replies_on_connection = 0
        self._quiet_breaks = 0
        """Fresh connections in a row that broke before any reply."""
        self._stop_seen = False
        """In the thread: ``close`` queued the stop while jobs were being served."""
        self.last_connection: Connection | None = None
        """The connection most recently opened (its ``capacity`` is read on the event loop)."""

    def submit(self, job: RedisJob) -> asyncio.Future:
        """Queue ``job``; the future resolves to it once every reply is read or the connection failed."""
        job.loop = asyncio.get_running_loop()
        job.future = job.loop.create_future()
        if self._thread is None:
            self._on_stop = None
            self._thread = threading.Thread(target=self._run, name=f"tiercache-{self.name}", daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job.future

    async def close(self) -> None:
        """Stop the thread: jobs still queued fail as ``closed``; a blocked receive is aborted."""
        if self._thread is None:
            return
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        self._on_stop = (loop, stopped)
        self._queue.put(_STOP)
        conn = self._conn
        if conn is not None:
            conn.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped, CLOSE_TIMEOUT_S)
        self._thread = None

    # -- the thread ------------------------------------------------------

    def _run(self) -> None:
        stop = False
        try:
            while not stop:
                job = self._queue.get()
                stop = job is _STOP or self._serve(job)
        finally:
            self._drop_connection()
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not _STOP:
                    self._fail([job], "closed", "closed: the tier is closing")
            if self._on_stop is not None:
                loop, stopped = self._on_stop
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(_set_done, stopped)

    def _serve(self, first: RedisJob) -> bool:
        """Serve ``first`` and every job queued while requests are in flight; True if told to stop.

        A connection that breaks under established traffic (reset, closed, a reply
        stream lost track of) is dropped and replaced: what was not answered is
        sent again on a fresh connection. The jobs fail when no connection can be
        opened, on a timeout, or when ``MAX_QUIET_BREAKS`` fresh connections in a
        row broke before any reply.
        """
        sending: deque[RedisJob] = deque([first])
        reading: deque[RedisJob] = deque()
        self._stop_seen = False
        while True:
            opening = self._conn is None
            try:
                if self._conn is None:
                    self._conn = self._opener()
                    self.connects += 1
                    self.last_connection = self._conn
                    self._replies_on_connection = 0
                opening = False
                self._pump(self._conn, sending, reading)
                return self._stop_seen
            except BaseException as error:  # every failure becomes an outcome
                kind = failure_kind(error)
                self._drop_connection()
                detail = error.detail if isinstance(error, ConnectionFailed) else str(error)
                jobs = list(dict.fromkeys([*reading, *sending]))
                reading.clear()
                sending.clear()
                cause = f"{kind}: {detail or type(error).__name__}"
                if opening or kind not in BROKEN_KINDS or not self._replace_connection(cause):
                    self._fail(jobs, kind, cause)
                    return self._stop_seen
                sending.extend(self._rewind(jobs))
                if not sending:
                    return self._stop_seen

    def _replace_connection(self, cause: str) -> bool:
        """After a connection broke: whether to open another (not while closing, nor after
        ``MAX_QUIET_BREAKS`` fresh ones in a row broke before any reply: then the server, not a
        connection, is failing)."""
        if self._on_stop is not None:  # ``close`` aborted the connection
            return False
        self._quiet_breaks = 0 if self._replies_on_connection else self._quiet_breaks + 1
        if self._quiet_breaks > MAX_QUIET_BREAKS:
            self._quiet_breaks = 0
            return False
        self.replaced += 1
        logger.debug("redis tier %s: connection replaced (%s)", self.name, cause)
        return True

    def _rewind(self, jobs: list[RedisJob]) -> list[RedisJob]:
        """The jobs of a broken connection, to be sent again from their first unanswered request
        (cancelled ones are complete: they send nothing more)."""
        again = []
        for job in jobs:
            job.sent = job.read
            job.on_wire = False
            if job.cancelled:
                self._complete(job)
            else:
                again.append(job)
        return again

    def _pump(self, conn: Connection, sending: deque[RedisJob], reading: deque[RedisJob]) -> None:
        """Send and read on ``conn`` until no job is left (new ones are taken from the queue)."""
        in_flight = 0
        while sending or reading:
            while True:
                if not sending and not self._stop_seen and not self._queue.empty():
                    queued = self._queue.get_nowait()  # only this thread takes from the queue
                    if queued is _STOP:
                        self._stop_seen = True
                    else:
                        sending.append(queued)
                if not sending:
                    break
                job = sending[0]
                if job.sent == 0 and (job.cancelled or not job.begin(conn)):
                    sending.popleft()
                    self._complete(job)
                    continue
                if job.sent == job.count or job.cancelled:
                    sending.popleft()
                    continue
                window = job.window(self.window)
                size = min(job.send_group(window), window, job.count - job.sent)
                if in_flight and in_flight + size > window:
                    break
                if not job.on_wire:
                    job.on_wire = True
                    reading.append(job)
                conn.send(job.requests(job.sent, job.sent + size))
                job.sent += size
                in_flight += size
            while reading and reading[0].done:
                self._complete(reading.popleft())
            if not reading:
                continue
            job = reading[0]
            # Read down to where the next send group fits (or half a window when nothing
            # waits to be sent: new jobs are looked for from there on, one reply at a time).
            window = (sending[0] if sending else job).window(self.window)
            next_group = sending[0].send_group(window) if sending else window // 2
            replies = min(job.sent - job.read, max(1, in_flight + next_group - window))
            job.read_replies(conn, replies, in_flight - replies)
            in_flight -= replies
            self._replies_on_connection += replies
            if job.done:
                self._complete(reading.popleft())

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _fail(self, jobs: list[RedisJob], kind: str, error: str) -> None:
        for job in jobs:
            job.failure = kind
            job.error = error
            job.outcomes[kind] += job.count - job.read
            self._complete(job)

    @staticmethod
    def _complete(job: RedisJob) -> None:
        job.finish()
        if job.loop is None or job.future is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            job.loop.call_soon_threadsafe(_resolve, job.future, job)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
