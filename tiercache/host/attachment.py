"""One attachment to the host server: its socket, the calls and fetches awaiting the server, and the handles an
engine holds (``ServedHit``, ``ServedFetch``). No thread of its own: the caller reads the server's frames.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiercache.host import wire
from tiercache.host.region import HostRegion
from tiercache.host.wire import Event, Op, Status

log = logging.getLogger(__name__)


class HostAttachError(RuntimeError):
    """The server holds another model, page format or protocol: this engine cannot share its tier."""


class Detached(Exception):
    """No server answered in time (or none is attached): the call is a miss."""


@dataclass(eq=False)
class ServedHit:
    """What ``HostTiers.lookup`` found, leased on the server until ``fetch`` or ``release``."""

    keys: list[bytes]
    tiers: list[str]
    hit_id: int = 0
    link: Attachment | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)


@dataclass(eq=False)
class ServedFetch:
    """A hit's blocks being brought into the server's region for the engine to copy out of (as ``HostFetch``)."""

    fetch_id: int
    link: Attachment | None
    _slots: list[int]
    _done: threading.Event = field(default_factory=threading.Event)

    def ready(self) -> bool:
        """Every block has arrived or failed (what the server sent is read first, without waiting)."""
        if not self._done.is_set() and self.link is not None:
            self.link.pump(0.0)
        return self._done.is_set()

    def slots(self) -> list[int]:
        """The leading slots the engine may copy now (all that arrived once ready)."""
        return list(self._slots)

    @property
    def region(self) -> bytes:
        """The token of the region its slots are in (b"": none; a server restarted since has another)."""
        return self.link.region.token if self.link is not None else b""

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self._done.is_set() and self.link is not None and (left := deadline - time.monotonic()) > 0:
            self.link.pump(left)
        return self._done.is_set()

    def release(self) -> None:
        """The engine is done with the slots: the server's pins go (at once if the server took them back)."""
        if self.link is not None:
            with contextlib.suppress(Detached):
                self.link.post(Op.RELEASE_FETCH, [self.fetch_id])
            self.link = None

    def arrived(self, slots: list[int]) -> None:
        self._slots = slots
        self._done.set()


def ended_fetch() -> ServedFetch:
    fetch = ServedFetch(0, None, [])
    fetch._done.set()
    return fetch


class Attachment:
    """One attachment: the socket, the replies and fetches awaiting the server. No thread of its own: a caller
    waiting for the server reads the socket itself (one reader at a time) and hands each frame to whom it is for,
    so a call costs one round trip and no hand-off between threads."""

    def __init__(self, sock: socket.socket, region: HostRegion, names: list[str], frame_timeout_s: float,
                 on_break: Callable[[Attachment], None]) -> None:
        sock.settimeout(frame_timeout_s)  # a frame begun but stalled, or a send the server does not take, breaks it
        self.sock, self.region, self.names = sock, region, names
        self._frames = wire.FrameReader(sock)
        self._on_break = on_break
        self._ids = itertools.count(1)
        self._replies: dict[int, tuple[int, Any]] = {}
        self._fetches: dict[int, ServedFetch] = {}
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._reading = threading.Lock()
        self.alive = True

    def call(self, op: Op, args: list[Any], timeout_s: float) -> Any:
        """The server's result (``Detached``: no reply within ``timeout_s``, or the link broke; then it is broken;
        ``HostAttachError``: the server refused the call)."""
        deadline = time.monotonic() + timeout_s
        call_id = next(self._ids)
        self._send([call_id, int(op), args])
        while (reply := self._reply(call_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken(f"no reply to {op.name} within {timeout_s} s")
                raise Detached
            self.pump(left, call_id)
        status, body = reply
        if status != Status.OK:
            raise HostAttachError(str(body))
        return body

    def post(self, op: Op, args: list[Any]) -> None:
        """Send a call the server answers with no reply (call id 0)."""
        self._send([wire.NO_REPLY_CALL_ID, int(op), args])

    def expect(self, fetch: ServedFetch) -> None:
        """``fetch`` ends when the server says its blocks arrived, or when the link breaks."""
        with self._lock:
            if self.alive:
                self._fetches[fetch.fetch_id] = fetch
                return
        fetch.arrived([])

    def pump(self, wait_s: float, call_id: int | None = None) -> None:
        """Read what the server sent, waiting at most ``wait_s`` for the first frame (not at all while another
        thread reads, but for a waiting caller's turn); stop at ``call_id``'s reply."""
        taken = self._reading.acquire(timeout=wait_s) if wait_s > 0 else self._reading.acquire(blocking=False)
        if not taken:
            return
        try:
            first = True
            while self.alive and (call_id is None or call_id not in self._replies):
                if not self._frames.buffered():
                    ready, _, _ = select.select([self.sock], [], [], wait_s if first else 0.0)
                    if not ready:
                        return
                first = False
                self._dispatch(*self._frames.frame())
        except (wire.WireError, OSError, ValueError) as error:
            self.broken(str(error))
        finally:
            self._reading.release()

    def broken(self, why: str) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            fetches, self._fetches = self._fetches, {}
        log.warning("tiercache host client: detached from the host server: %s", why)
        for fetch in fetches.values():
            fetch.arrived([])
        with contextlib.suppress(OSError):  # tells the server at once, wakes a reader
            self.sock.shutdown(socket.SHUT_RDWR)
        self._on_break(self)

    def _reply(self, call_id: int) -> tuple[int, Any] | None:
        with self._lock:
            reply = self._replies.pop(call_id, None)
            if reply is None and not self.alive:
                raise Detached
        return reply

    def _send(self, message: list[Any]) -> None:
        if not self.alive:
            raise Detached
        try:
            with self._sending:
                wire.send(self.sock, message)
        except OSError as error:
            self.broken(f"a send failed: {error}")
            raise Detached from None

    def _dispatch(self, call_id: int, code: int, body: Any) -> None:
        if call_id != wire.EVENT_CALL_ID:
            with self._lock:
                self._replies[call_id] = (code, body)
        elif code == Event.FETCHED:
            fetch_id, slots = body
            with self._lock:
                fetch = self._fetches.pop(fetch_id, None)
            if fetch is not None:
                fetch.arrived(list(slots))
