"""RESP over one blocking socket: requests out with ``sendmsg``, replies parsed in place.

A ``Connection`` is driven by one worker thread at a time (``abort`` may come
from any thread). Small reads (reply lines, headers) go through a small line
buffer; values are received straight into the caller's memory.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache.tiers.redis.node import Capacity

LINE_BUFFER_BYTES = 1024
"""Small reads (reply lines, headers) never pull more than this from the socket,
so at most this many payload bytes are copied instead of received in place."""
CRLF = b"\r\n"
WAITALL = getattr(socket, "MSG_WAITALL", 0)
MAX_READAHEAD = 32
"""The most bytes of the next reply a value's receive may take along (a reply line is shorter)."""
SENDMSG_MAX_BUFFERS = 512
"""Below the kernel's IOV_MAX (1024) per sendmsg call."""


class ConnectionFailed(Exception):
    """Inside a worker thread: the connection is unusable; ``kind`` names why, ``detail`` says more."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


ERROR_OUTCOMES = {
    "MOVED": "moved",
    "ASK": "moved",
    "TRYAGAIN": "moved",
    "CLUSTERDOWN": "moved",
    "OOM": "server_oom",
    "NOAUTH": "auth_noauth",
    "WRONGPASS": "auth_wrongpass",
    "NOPERM": "auth_noperm",
}
"""The outcome an error reply is counted under, by its code (any other: ``server_error``).
``auth_*`` name why the server refused us: no credentials sent although it needs some
(``NOAUTH``), wrong user or password (``WRONGPASS``), or an ACL that denies the command
or key (``NOPERM``)."""


@dataclass(frozen=True)
class ServerError:
    """A RESP error reply, as a value."""

    message: str

    @property
    def outcome(self) -> str:
        """The counter this reply is counted under (``ERROR_OUTCOMES``)."""
        return ERROR_OUTCOMES.get(self.message.split(" ", 1)[0], "server_error")

    @property
    def auth(self) -> bool:
        """Whether the server refused us for who we are (``NOAUTH``, ``WRONGPASS``, ``NOPERM``)."""
        return self.outcome.startswith("auth_")


def command(*parts: bytes) -> bytes:
    """Encode one RESP command (array of bulk strings)."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)



class Connection:
    """One blocking socket, used by one worker thread at a time (``abort`` from any thread)."""

    def __init__(self, sock: socket.socket, staging_bytes: int, header_bytes: int, tls: bool) -> None:
        self.sock = sock
        self._tls = tls
        self._line = bytearray(LINE_BUFFER_BYTES)
        self._line_view = memoryview(self._line)
        self._start = 0
        self._end = 0
        self.staging = memoryview(bytearray(staging_bytes))
        self.header = bytearray(header_bytes)
        """Where a value's header is received (the fast path compares it in place)."""
        self.header_view = memoryview(self.header)
        self._tails = [self._line_view[: len(CRLF) + readahead] for readahead in range(MAX_READAHEAD + 1)]
        """The CRLF that ends a value plus 0..MAX_READAHEAD bytes of what follows, by read-ahead."""
        self.capacity: Capacity | None = None
        """What the server said about its memory bound (set when the connection opens)."""

    def abort(self) -> None:
        """Make a blocked send/recv in the worker thread fail at once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the socket (errors ignored)."""
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, buffers: list[bytes | memoryview]) -> None:
        """Send the buffers (bytes, or views in byte format: ``len`` counts bytes) back to back
        without joining them."""
        if self._tls:
            for buffer in buffers:
                self.sock.sendall(buffer)
            return
        views = list(buffers)
        first = 0
        while first < len(views):
            sent = self.sock.sendmsg(views[first : first + SENDMSG_MAX_BUFFERS])
            while sent:
                if sent >= len(views[first]):
                    sent -= len(views[first])
                    first += 1
                else:
                    views[first] = memoryview(views[first])[sent:]
                    sent = 0

    def receive_value(self, line: bytes, dest: memoryview, readahead: int) -> bool:
        """The fast path of a value whose reply line is already buffered and is exactly ``line``.

        Receives the rest of the header (into ``header``), the payload straight into
        ``dest``, the closing CRLF and ``readahead`` bytes of whatever follows (never
        more than pending replies must contain, so it cannot block) in one
        ``recvmsg_into``. Returns False, having consumed nothing, when the buffer
        does not start with ``line`` (a miss, an error, another length, a partial
        line) or holds more than the header after it, or on TLS (no
        ``recvmsg_into``): the caller then takes the general path.
        """
        start, end = self._start, self._end
        extra = end - start - len(line)
        header = self.header_view
        if extra < 0 or extra > len(header) or self._tls or not self._line.startswith(line, start, end):
            return False
        tail = self._tails[readahead]
        if extra:
            header[:extra] = self._line_view[end - extra : end]
            views = [header[extra:], dest, tail] if extra < len(header) else [dest, tail]
        else:
            views = [header, dest, tail]
        self._start = self._end = 0
        count = self.sock.recvmsg_into(views, 0, WAITALL)[0]
        if count != len(header) - extra + len(dest) + len(tail):
            self._receive_rest(views, count)
        if not self._line.startswith(CRLF):
            raise ConnectionFailed("protocol", "bulk reply not terminated by CRLF")
        self._start, self._end = len(CRLF), len(tail)
        return True

    def _receive_rest(self, views: list[memoryview], count: int) -> None:
        """Finish a ``recvmsg_into`` that returned early (a signal, a slow sender)."""
        while True:
            if count == 0:
                raise ConnectionFailed("connection", "closed by the server")
            while views and count >= len(views[0]):
                count -= len(views.pop(0))
            if not views:
                return
            if count:
                views[0] = views[0][count:]
            count = self.sock.recvmsg_into(views, 0, WAITALL)[0]

    def _recv_into(self, view: memoryview, flags: int) -> int:
        count = self.sock.recv_into(view, len(view), 0 if self._tls else flags)
        if count == 0:
            raise ConnectionFailed("connection", "closed by the server")
        return count

    def _fill(self) -> None:
        """Receive whatever is available (at most the free space of the line buffer)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > 0:
            pending = self._end - self._start
            self._line_view[:pending] = self._line_view[self._start : self._end]
            self._start, self._end = 0, pending
        if self._end == len(self._line):
            raise ConnectionFailed("protocol", "reply line too long")
        self._end += self._recv_into(self._line_view[self._end :], 0)

    def read_line(self) -> bytes:
        """One reply line without its CRLF."""
        while True:
            index = self._line.find(CRLF, self._start, self._end)
            if index >= 0:
                line = bytes(self._line_view[self._start : index])
                self._start = index + len(CRLF)
                return line
            self._fill()

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: buffered bytes first, then straight from the socket."""
        take = min(len(view), self._end - self._start)
        if take:
            view[:take] = self._line_view[self._start : self._start + take]
            self._start += take
        rest = view[take:]
        while len(rest):
            rest = rest[self._recv_into(rest, WAITALL) :]

    def skip(self, count: int) -> None:
        """Discard ``count`` bytes (the rest of a value already judged invalid)."""
        while count > 0:
            chunk = min(count, len(self.staging))
            self.read_into(self.staging[:chunk])
            count -= chunk

    def prefetch(self, count: int) -> None:
        """Have at least ``count`` bytes buffered, receiving exactly the missing ones.

        The caller must know that many bytes are on their way (pending replies),
        or this blocks until the socket times out.
        """
        missing = count - (self._end - self._start)
        if missing <= 0:
            return
        if self._start:
            pending = self._end - self._start
            self._line_view[:pending] = self._line_view[self._start : self._end]
            self._start, self._end = 0, pending
        if self._end + missing > len(self._line):
            raise ConnectionFailed("protocol", "read-ahead beyond the line buffer")
        while missing > 0:
            count = self._recv_into(self._line_view[self._end : self._end + missing], WAITALL)
            self._end += count
            missing -= count

    def consume_repeated(self, reply: bytes, most: int) -> int:
        """Consume the buffered replies (reading more if none is) when they are all ``reply``, at most
        ``most`` of them; how many. 0 when any other reply is among them: read those one by one."""
        if self._start == self._end:
            self._fill()
        count = min(most, (self._end - self._start) // len(reply))
        if count and not self._line.startswith(reply * count, self._start):
            return 0
        self._start += count * len(reply)
        return count

    def buffered_prefix_of(self, line: bytes) -> int:
        """How many bytes are buffered if they are a prefix of ``line``; -1 if they are not."""
        buffered = self._end - self._start
        if buffered > len(line) or not line.startswith(self._line[self._start : self._end]):
            return -1
        return buffered

    def expect_crlf(self, readahead: int = 0) -> None:
        """Consume the CRLF that ends a bulk reply (anything else means the stream is lost).

        Also receives ``readahead`` bytes of what follows in the same system call
        (as many as pending replies must contain, so it cannot block).
        """
        self.prefetch(len(CRLF) + readahead)
        if self._line_view[self._start : self._start + len(CRLF)] != CRLF:
            raise ConnectionFailed("protocol", "bulk reply not terminated by CRLF")
        self._start += len(CRLF)

    def read_reply(self) -> Any:
        """One RESP2 reply as a value: bytes, int, None, list, or ``ServerError``."""
        line = self.read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ServerError(rest.decode(errors="replace"))
        try:
            number = int(rest)
        except ValueError:
            raise ConnectionFailed("protocol", f"unexpected reply {line[:40]!r}") from None
        if kind == b":":
            return number
        if kind == b"$":
            if number < 0:
                return None
            value = bytearray(number)
            self.read_into(memoryview(value))
            self.expect_crlf()
            return bytes(value)
        if kind == b"*":
            return None if number < 0 else [self.read_reply() for _ in range(number)]
        raise ConnectionFailed("protocol", f"unexpected reply {line[:40]!r}")

    def call(self, *parts: bytes) -> Any:
        """One request/reply round trip (set-up and control commands)."""
        self.send([command(*parts)])
        return self.read_reply()
