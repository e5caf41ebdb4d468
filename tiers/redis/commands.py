"""The tier's commands as lane jobs: GET (fast path + general path), SET, EXISTS, UNLINK, control.

GET fast path. When the buffered reply line is exactly the expected
``$<header + block>`` line, one ``recvmsg_into`` receives header, payload (into
the destination) and CRLF plus the next reply's line, and ``Codec.check_in_place``
compares the header with precomputed bytes before verifying the payload (the
checksum, or the keyed MAC). Everything else (a miss, an error reply such as
``-WRONGTYPE``, a value of another length, an lz4 value, TLS, ``stage_reads``)
takes the general path: the reply line is parsed, the header validated field by
field, and a bad value is skipped without touching the destination's neighbours. A
compressed or coded value is received into the connection's staging buffer and
decoded from there into the destination.
Hits are counted in plain integers; other outcomes by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import FLAG_CODED, FLAG_LZ4, HEADER_SIZE, DecodeStatus
from tiercache.tiers.base import Presence
from tiercache.tiers.redis.pipelined import RedisJob
from tiercache.tiers.redis.resp import CRLF, Connection, ConnectionFailed, ServerError, command

GET_REQUEST = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n"
"""A GET command, formatted with the key's length and the key."""
OK_REPLY = b"+OK\r\n"
"""SET's answer when the value was stored."""
BYTES = "bytes"
"""Outcome counters carry the payload bytes moved under this name."""
HIT = "hit"
UNEXPECTED_REPLY = "unexpected_reply"
"""Outcome of a reply that is neither an error nor one the command can give (the key's answer stays unknown)."""
MIN_REPLY_BYTES = 4
"""The shortest reply any command of the tier can get (``:0\\r\\n``): how far a read may look ahead."""
GET_MIN_REPLY_BYTES = 5
"""The shortest GET reply (``$-1\\r\\n``): how much of the current reply can always be received."""
SURE_PREFIX_BYTES = 5
"""A buffered ``$dddd`` (four digits) is a bulk reply of at least 1000 bytes: the rest of its
line can be received without looking at pending replies."""
SET_GROUP_VALUES = 8
"""SETs are checksummed and sent in groups of this many values (at most a third of the window),
so that the server stores the first group while the next is checksummed."""
KEYS_IN_FLIGHT = 512
"""EXISTS or UNLINK requests in flight per connection at most (about 60 bytes each, a reply of 4): a prompt's
presence check of up to this many blocks is one round trip."""
INVALID_OUTCOMES = frozenset(status.value for status in DecodeStatus if status is not DecodeStatus.OK)
"""A value that failed validation: reported to the tier's ``invalid_values``, which removes it if damaged."""


@dataclass(frozen=True)
class ReadPlan:
    """What every GET of one tier shares."""

    codec: Codec
    block_bytes: int
    stage_reads: bool
    line: bytes
    """The reply line of a value of the expected size: ``$<HEADER_SIZE + block_bytes>\\r\\n``."""

    @classmethod
    def of(cls, codec: Codec, block_bytes: int, stage_reads: bool) -> ReadPlan:
        """The plan of a tier whose blocks are ``block_bytes`` long."""
        return cls(codec, block_bytes, stage_reads, b"$%d\r\n" % (HEADER_SIZE + block_bytes))


class GetJob(RedisJob):
    """GET of ``keys[i]`` into ``dests[i]`` for ``i`` in ``indices``; ``results[i]`` True where filled."""

    def __init__(
        self,
        plan: ReadPlan,
        indices: list[int],
        keys: Sequence[bytes],
        redis_keys: Sequence[bytes],
        dests: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        super().__init__(len(indices))
        self.plan = plan
        self.indices = indices
        self.keys = keys
        self.redis_keys = redis_keys
        self.dests = dests
        self.results = results
        self.hits = 0
        self.invalid: list[tuple[int, DecodeStatus]] = []
        """Indices whose value failed validation, and why."""

    def requests(self, start: int, stop: int) -> list[bytes | memoryview]:
        keys = self.redis_keys
        return [b"".join([GET_REQUEST % (len(keys[i]), keys[i]) for i in self.indices[start:stop]])]

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        position = self.indices[index]
        dest = self.dests[position]
        if dest.format != "B" or dest.ndim != 1:
            dest = memoryview(dest).cast("B")
        plan = self.plan
        readahead = MIN_REPLY_BYTES * pending_after
        if readahead > len(plan.line):
            readahead = len(plan.line)
        if plan.stage_reads or not conn.receive_value(plan.line, dest, readahead):
            self._read_slowly(conn, position, dest, readahead)
            return
        status = plan.codec.check_in_place(self.keys[position], conn.header, dest)
        if status is DecodeStatus.OK:
            self.hits += 1
            self.results[position] = True
        else:
            self._count(position, status.value)

    def _read_slowly(self, conn: Connection, position: int, dest: memoryview, readahead: int) -> None:
        """The reply line is not (all) buffered yet, or is not the expected one."""
        line = self.plan.line
        key = self.keys[position]
        conn.prefetch(min(len(line), GET_MIN_REPLY_BYTES + readahead))
        if conn.buffered_prefix_of(line) >= SURE_PREFIX_BYTES and line[1:SURE_PREFIX_BYTES].isdigit():
            conn.prefetch(len(line))
        if not self.plan.stage_reads and conn.receive_value(line, dest, readahead):
            status = self.plan.codec.check_in_place(key, conn.header, dest)
            outcome: str | ServerError = HIT if status is DecodeStatus.OK else status.value
        else:
            outcome = read_value(conn, self.plan, key, dest, readahead)
        if isinstance(outcome, ServerError):
            self.error = outcome.message
            outcome = outcome.outcome
        if outcome == HIT:
            self.hits += 1
            self.results[position] = True
        else:
            self._count(position, outcome)

    def _count(self, position: int, outcome: str) -> None:
        self.outcomes[outcome] += 1
        if outcome in INVALID_OUTCOMES:
            self.invalid.append((position, DecodeStatus(outcome)))

    def finish(self) -> None:
        if self.hits:
            self.outcomes[HIT] += self.hits
            self.outcomes[BYTES] += self.hits * self.plan.block_bytes


def _status_outcome(status: DecodeStatus) -> str:
    return HIT if status is DecodeStatus.OK else status.value


def read_value(
    conn: Connection, plan: ReadPlan, key: bytes, dest: memoryview, readahead: int
) -> str | ServerError:
    """The general path: read one GET reply and, if valid, its payload into ``dest``; the outcome
    (an error reply as itself)."""
    line = conn.read_line()
    if line[:1] == b"-":
        return ServerError(line[1:].decode(errors="replace"))
    if line[:1] != b"$":
        raise ConnectionFailed("protocol", f"unexpected GET reply {line[:40]!r}")
    length = int(line[1:])
    if length < 0:
        return "miss"
    staging = conn.staging
    if length > len(staging):
        conn.skip(length)
        conn.expect_crlf(readahead)
        return DecodeStatus.BAD_LENGTH.value
    codec = plan.codec
    if plan.stage_reads or length != HEADER_SIZE + len(dest):
        conn.read_into(staging[:length])
        conn.expect_crlf(readahead)
        if length >= HEADER_SIZE:  # after a hit, ``conn.header`` holds the value's header on every path
            conn.header_view[:] = staging[:HEADER_SIZE]
        return _status_outcome(codec.decode_into(key, staging[:length], dest).status)
    conn.read_into(conn.header_view)
    header = codec.check_header(key, conn.header, length)
    if isinstance(header, DecodeStatus):
        conn.skip(length - HEADER_SIZE)
        conn.expect_crlf(readahead)
        return header.value
    if header.flags & (FLAG_LZ4 | FLAG_CODED):  # decoded from staging into the destination
        staging[:HEADER_SIZE] = conn.header_view
        conn.read_into(staging[HEADER_SIZE:length])
        conn.expect_crlf(readahead)
        return _status_outcome(codec.decode_into(key, staging[:length], dest).status)
    conn.read_into(dest)
    conn.expect_crlf(readahead)
    if header.raw_length != len(dest):
        return DecodeStatus.BAD_LENGTH.value
    return _status_outcome(codec.verify(conn.header, dest, header.checksum))


class PutJob(RedisJob):
    """SET of ``payloads[i]`` under ``keys[i]`` for ``i`` in ``indices`` (one command per value)."""

    def __init__(
        self,
        codec: Codec,
        indices: list[int],
        keys: Sequence[bytes],
        redis_keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        results: list[bool],
        set_tail: bytes,
        allow_unbounded: bool,
        checksums: Sequence[int | None],
    ) -> None:
        super().__init__(len(indices))
        self.codec = codec
        self.checksums = checksums
        """Each payload's checksum where the writer carried it (None: hashed here, in the I/O thread)."""
        self.indices = indices
        self.keys = keys
        self.redis_keys = redis_keys
        self.payloads = payloads
        self.results = results
        self._set_tail = set_tail
        self._set_parts = b"*5\r\n" if len(set_tail) > len(CRLF) else b"*3\r\n"
        self._allow_unbounded = allow_unbounded
        self._sizes = [0] * len(indices)
        self._stored = 0
        self._stored_bytes = 0

    def send_group(self, window: int) -> int:
        return max(1, min(SET_GROUP_VALUES, window // 3))

    def begin(self, conn: Connection) -> bool:
        capacity = conn.capacity
        if (capacity is None or not capacity.bounded) and not self._allow_unbounded:
            denied = capacity is not None and capacity.denied is not None
            self.outcomes["refused_noperm" if denied else "refused_unbounded"] += self.count
            return False
        return True

    def requests(self, start: int, stop: int) -> list[bytes | memoryview]:
        buffers: list[bytes | memoryview] = []
        for j in range(start, stop):
            position = self.indices[j]
            header, stored = self.encoded(position)
            rkey = self.redis_keys[position]
            size = len(header) + len(stored)
            self._sizes[j] = size
            buffers += (
                b"%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (self._set_parts, len(rkey), rkey, size),
                header,
                stored,
                self._set_tail,
            )
        return buffers

    def encoded(self, position: int) -> tuple[bytes, bytes | memoryview]:
        """The header and stored payload of value ``position`` (checksummed here, in the I/O thread, unless
        the writer carried its checksum)."""
        return self.codec.encode(self.keys[position], self.payloads[position], 0, self.checksums[position])

    def read_replies(self, conn: Connection, count: int, pending_after: int) -> None:
        """All the buffered ``+OK`` replies at once; anything else one by one."""
        while count:
            start = self.read
            stored = 0 if self.cancelled else conn.consume_repeated(OK_REPLY, count)
            if stored:
                self._mark_stored(start, start + stored)
                self.read += stored
                count -= stored
            else:
                super().read_replies(conn, 1, pending_after + count - 1)
                count -= 1

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        reply = conn.read_reply()
        if reply == b"OK":
            self._mark_stored(index, index + 1)
        elif isinstance(reply, ServerError):
            self.outcomes[reply.outcome] += 1
            self.error = reply.message
        else:
            self.outcomes["server_error"] += 1

    def _mark_stored(self, start: int, stop: int) -> None:
        """Requests ``start..stop-1`` were answered ``+OK``."""
        for index in range(start, stop):
            self.results[self.indices[index]] = True
        self._stored += stop - start
        self._stored_bytes += sum(self._sizes[start:stop])

    def finish(self) -> None:
        if self._stored:
            self.outcomes["ok"] += self._stored
            self.outcomes[BYTES] += self._stored_bytes


class KeysJob(RedisJob):
    """One small command per key (EXISTS, UNLINK): ``results[i]`` is the key's presence where it was answered."""

    def __init__(
        self, verb: bytes, indices: list[int], redis_keys: Sequence[bytes], results: list[Presence] | None,
        missing: str,
    ) -> None:
        super().__init__(len(indices))
        self.verb = verb
        self.indices = indices
        self.redis_keys = redis_keys
        self.results = results
        self._missing = missing

    def window(self, values_window: int) -> int:
        """Keys asked at once: a reply is a few bytes, whatever the window for values."""
        return KEYS_IN_FLIGHT

    def requests(self, start: int, stop: int) -> list[bytes | memoryview]:
        return [b"".join(command(self.verb, self.redis_keys[i]) for i in self.indices[start:stop])]

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        reply = conn.read_reply()
        if isinstance(reply, ServerError):
            self.outcomes[reply.outcome] += 1
            self.error = reply.message
        elif self.results is None:
            self.outcomes["ok"] += 1
        elif reply == 1:
            self.results[self.indices[index]] = Presence.HELD
            self.outcomes[HIT] += 1
        elif reply == 0:
            self.results[self.indices[index]] = Presence.ABSENT
            self.outcomes[self._missing] += 1
        else:
            self.outcomes[UNEXPECTED_REPLY] += 1


class ControlJob(RedisJob):
    """One control command (PING, CLUSTER SLOTS, ...); ``reply`` holds its answer."""

    def __init__(self, *parts: bytes) -> None:
        super().__init__(1)
        self._request = command(*parts)
        self.reply: Any = None

    def requests(self, start: int, stop: int) -> list[bytes | memoryview]:
        return [self._request]

    def read_reply(self, conn: Connection, index: int, pending_after: int) -> None:
        self.reply = conn.read_reply()
        self.outcomes["ok"] += 1
