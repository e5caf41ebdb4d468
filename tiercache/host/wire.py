"""The host server's wire: length-prefixed MessagePack frames over a Unix socket, never pickle.

A call is ``[call_id, op, args]``; its reply ``[call_id, status, result]``
(none for call id 0: the engine does not wait for it); an event the server
pushes unasked is ``[0, event, payload]`` (a fetch that arrived). Frames are
bounded (``MAX_FRAME_BYTES``): a peer that sends more, or bytes that do not
decode, is a broken connection (``WireError``), never a value.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import Any

import msgspec

PROTOCOL_VERSION = 1
"""Bumped when a call's arguments or result change: a client of another version is refused at ``HELLO``."""
MAX_FRAME_BYTES = 64 << 20
"""Bound on one frame (a lookup of a million keys is 18 MB): more is a peer's error, not a message."""
EVENT_CALL_ID = 0
"""The call id of what the server pushes unasked; calls count from 1."""
NO_REPLY_CALL_ID = 0
"""The call id of a call the engine wants no reply to (a release, the end of its writes)."""
READ_BYTES = 1 << 16
"""What one ``recv`` asks for."""
_LENGTH = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class Op(enum.IntEnum):
    """A call to the server: one per ``LowerTiers`` method an engine uses, and the attach."""

    HELLO = 1
    LOOKUP = 2
    ASK = 3
    FLUSH_PRESENCE = 4
    FORGET = 5
    WAIT_FOR_ANSWERS = 6
    RELEASE_HIT = 7
    FETCH = 8
    RELEASE_FETCH = 9
    BEGIN_WRITES = 10
    END_WRITES = 11
    RESET_CPU_TIER = 12
    OBSERVE_PREFILL = 13
    LEVEL_BLOCKS = 14
    STATS = 15


class Event(enum.IntEnum):
    """What the server pushes: ``FETCHED`` ``[fetch_id, oks]`` once a fetch's blocks have arrived or failed."""

    FETCHED = 1


class Status(enum.IntEnum):
    """A reply's status: the result, or the server's refusal (its message)."""

    OK = 0
    REFUSED = 1


class WireError(ConnectionError):
    """The peer went away, or sent what is not a frame of this protocol."""


def send(sock: socket.socket, message: list[Any]) -> None:
    """Write one frame (the caller serializes writers)."""
    payload = _encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


class FrameReader:
    """The frames of one socket, read through a buffer: a frame that arrives whole (the usual case) costs one
    ``recv``, and frames that arrive together are read once."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def buffered(self) -> bool:
        """Whether a whole frame is read already (no need to wait on the socket for it)."""
        return self._whole() is not None

    def frame(self) -> list[Any]:
        """The next frame (``WireError``: closed, oversized or undecodable)."""
        while (length := self._whole()) is None:
            chunk = self.sock.recv(READ_BYTES)
            if not chunk:
                raise WireError("the peer closed the connection")
            self._buffer += chunk
        payload = bytes(self._buffer[_LENGTH.size: _LENGTH.size + length])
        del self._buffer[: _LENGTH.size + length]
        try:
            message = _decoder.decode(payload)
        except msgspec.DecodeError as error:
            raise WireError(f"an undecodable frame: {error}") from None
        if not isinstance(message, list) or len(message) != 3 or not isinstance(message[0], int):
            raise WireError("a frame that is not [id, code, body]")
        return message

    def _whole(self) -> int | None:
        """The payload length of the buffered frame, if it is all there."""
        if len(self._buffer) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._buffer)
        if length > MAX_FRAME_BYTES:
            raise WireError(f"a frame of {length} bytes, above the bound of {MAX_FRAME_BYTES}")
        return length if len(self._buffer) >= _LENGTH.size + length else None
