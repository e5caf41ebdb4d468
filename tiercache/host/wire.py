"""The host server's wire: length-prefixed MessagePack frames over a Unix socket, never pickle.

A call is ``[call_id, op, args]``; its reply ``[call_id, status, result]``;
an event the server pushes unasked is ``[0, event, payload]`` (a fetch that
arrived). Frames are bounded (``MAX_FRAME_BYTES``): a peer that sends more, or
bytes that do not decode, is a broken connection (``WireError``), never a value.
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


def receive(sock: socket.socket) -> list[Any]:
    """Read one frame (``WireError``: closed, oversized or undecodable)."""
    (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {length} bytes, above the bound of {MAX_FRAME_BYTES}")
    try:
        message = _decoder.decode(_read_exactly(sock, length))
    except msgspec.DecodeError as error:
        raise WireError(f"an undecodable frame: {error}") from None
    if not isinstance(message, list) or len(message) != 3 or not isinstance(message[0], int):
        raise WireError("a frame that is not [id, code, body]")
    return message


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WireError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
