"""One engine attached to the host server: its calls answered in order, its leases, its events' outbox.

A connection thread reads the engine's calls and answers each (none to a call
of id 0); a writer thread sends the events the server pushes (a fetch that
arrived), so an engine that stops reading stalls only its own threads, never the
background loop every engine shares. What the engine holds is leased
(``leases``); when the connection ends the server waits for the engine's
process to exit (a pidfd from the socket's peer credentials), at most the lease
grace, then takes it all back. See docs/architecture.md, "The host cache server".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from tiercache.host import wire
from tiercache.host.leases import Leases
from tiercache.host.wire import Event, Op, Status
from tiercache.manager.lower_tiers import HostFetch, HostHit, LowerTiers

if TYPE_CHECKING:
    from tiercache.host.server import HostServer

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5
"""A send to an engine that does not read for this long ends its connection (its leases then wait out the grace)."""
GRACE_POLL_S = 0.2
"""How often a connection waiting out its engine's grace checks whether the server stops."""
MAX_WAIT_FOR_ANSWERS_S = 1.0
"""Bound on one ``WAIT_FOR_ANSWERS`` call, whatever the engine asked (it holds that engine's connection)."""


class EngineConnection:
    """One attached engine: its calls answered in order, its leases, its outbox."""

    def __init__(self, server: HostServer, connection_id: int, sock: socket.socket) -> None:
        self.server, self.id, self.sock = server, connection_id, sock
        self.tiers: LowerTiers = _NotAttached()  # type: ignore[assignment]  # until HELLO
        self.leases: Leases[HostHit, HostFetch] = Leases()
        self.ended = False
        """The connection has ended; its leases wait out the engine's grace (``_await_peer_exit``)."""
        self._peer = _peer_process(sock)
        """A pidfd of the engine's process (readable once it has exited), None where the kernel has none."""
        self._outbox: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._sending = threading.Lock()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
        self.thread = threading.Thread(target=self._serve, name=f"tiercache-host-{connection_id}", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"tiercache-host-{connection_id}-out", daemon=True)
        self._handlers = {
            Op.HELLO: self._hello, Op.LOOKUP: self._lookup, Op.ASK: self._ask,
            Op.FLUSH_PRESENCE: lambda: self.tiers.flush_presence(), Op.FORGET: self._forget,
            Op.WAIT_FOR_ANSWERS: lambda timeout_s: self.tiers.wait_for_answers(min(timeout_s,
                                                                                    MAX_WAIT_FOR_ANSWERS_S)),
            Op.RELEASE_HIT: self._release_hit, Op.FETCH: self._fetch, Op.RELEASE_FETCH: self._release_fetch,
            Op.BEGIN_WRITES: self._begin_writes, Op.END_WRITES: self._end_writes,
            Op.RESET_CPU_TIER: lambda: self.tiers.reset_cpu_tier(),
            Op.OBSERVE_PREFILL: lambda tokens, seconds: self.tiers.observe_prefill(tokens, seconds),
            Op.LEVEL_BLOCKS: lambda: self.tiers.level_blocks(),
            Op.STATS: lambda: json.loads(json.dumps(self.server.stats(), default=str)),
        }

    def abandon(self) -> None:
        """Close a connection never served (the server stopped as it came)."""
        self.sock.close()
        if self._peer is not None:
            os.close(self._peer)

    def shut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _serve(self) -> None:
        self._writer.start()
        frames = wire.FrameReader(self.sock)
        try:
            while True:
                call_id, op, args = frames.frame()
                reply = self._answer(call_id, op, args)
                if call_id != wire.NO_REPLY_CALL_ID:
                    with self._sending:
                        wire.send(self.sock, reply)
        except (wire.WireError, OSError):
            pass
        finally:
            self.ended = True
            self._outbox.put(None)
            self._writer.join(timeout=5)
            self.sock.close()
            if any(self.leases.counts().values()):
                self._await_peer_exit()
            if self._peer is not None:
                os.close(self._peer)
            self._take_back()
            self.server.ended(self)

    def _answer(self, call_id: int, op: int, args: Any) -> list[Any]:
        try:
            handler = self._handlers[Op(op)]
            if not isinstance(args, list):
                raise TypeError("arguments must be a list")
            return [call_id, Status.OK, handler(*args)]
        except Exception as error:  # the engine's mistake (or a bug) is its call's refusal, never the server's end
            log.warning("tiercache host server: engine %d's call %s refused: %s", self.id, op, error)
            return [call_id, Status.REFUSED, f"{type(error).__name__}: {error}"]

    def _write(self) -> None:
        """The events, sent apart from the replies: the loop that pushes them never waits on an engine's socket."""
        while (message := self._outbox.get()) is not None:
            try:
                with self._sending:
                    wire.send(self.sock, message)
            except OSError:
                self.shut()  # the reader sees it and takes the leases back
                return

    def _await_peer_exit(self) -> None:
        """Until the engine's process has exited, or the lease grace is over, or the server stops: a live engine's
        workers may still copy out of the slots it fetched. (Its socket closes before it is seen to exit.)"""
        if self._peer is None:
            return
        deadline = time.monotonic() + self.server.lease_grace_s
        while not self.server.stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            if select.select([self._peer], [], [], min(left, GRACE_POLL_S))[0]:
                return

    def _take_back(self) -> None:
        left = self.leases.drain()
        for hit in left.hits:
            self.tiers.release(hit)
        for fetch in left.fetches:
            fetch.release()
        if left.write_keys:
            self.tiers.end_writes(left.write_keys, left.write_slots, [False] * len(left.write_keys))
        for asker in left.askers:
            self.tiers.forget(asker)
        if left.hits or left.fetches or left.write_keys:
            log.info("tiercache host server: engine %d went away; took back %d hits, %d fetches, %d writes", self.id,
                     len(left.hits), len(left.fetches), len(left.write_keys))

    # ---- the calls -------------------------------------------------------------------------------------
    def _asker_key(self, asker: Any) -> Hashable:
        """The server's name of an engine's asker (engines' request ids may be the same)."""
        return self.id, asker if isinstance(asker, (str, int)) else str(asker)

    def _asker(self, asker: Any) -> Hashable | None:
        if asker is None:
            return None
        key = self._asker_key(asker)
        self.leases.asked(key)
        return key

    def _hello(self, version: int, root: bytes, bytes_per_block: int, block_size: int,
               description: dict[str, Any]) -> dict[str, Any]:
        if version != wire.PROTOCOL_VERSION:
            raise ValueError(f"protocol {version}; this server speaks {wire.PROTOCOL_VERSION}")
        tiers = self.server.tiers_for(description)
        if bytes(root) != tiers.namespace.root() or bytes_per_block != tiers.bytes_per_block \
                or block_size != tiers.block_size:
            raise ValueError(f"another model or page format: this server holds {tiers.namespace.model_id!r} "
                             f"({tiers.bytes_per_block} bytes, {tiers.block_size} tokens a block)")
        self.tiers = tiers
        region = self.server.region
        assert region is not None
        return {"region": str(region.path), "num_slots": region.num_slots, "slot_bytes": region.slot_bytes,
                "token": region.token, "names": tiers.names, "types": [tier.type for tier in tiers.config.tiers]}

    def _lookup(self, keys: list[bytes], local_only: bool, asker: Any, send: bool) -> list[Any] | None:
        hit = self.tiers.lookup(keys, local_only=local_only, asker=self._asker(asker), send=send)
        if hit is None:
            return None
        if not hit.num_blocks:  # nothing pinned, nothing to fetch: not leased (a miss per request would pile up)
            self.tiers.release(hit)
            return [0, []]
        return [self.leases.add_hit(hit), hit.tiers]

    def _ask(self, keys: list[bytes], asker: Any, send: bool) -> None:
        self.tiers.ask(keys, self._asker(asker), send=send)

    def _forget(self, asker: Any) -> None:
        key = self._asker_key(asker)
        self.leases.forgot(key)
        self.tiers.forget(key)

    def _release_hit(self, hit_id: int) -> None:
        hit = self.leases.take_hit(hit_id)
        if hit is not None:
            self.tiers.release(hit)

    def _fetch(self, hit_id: int, count: int | None, force_latest: bool) -> list[Any] | None:
        hit = self.leases.take_hit(hit_id)
        if hit is None:
            return None
        fetch = self.tiers.fetch(hit, count, force_latest=force_latest)
        fetch_id = self.leases.add_fetch(fetch)
        if fetch.ready():
            return [fetch_id, True, fetch.slots()]
        early = fetch.slots()
        fetch.arrived.add_done_callback(lambda _: self._outbox.put([wire.EVENT_CALL_ID, Event.FETCHED,
                                                                    [fetch_id, fetch.slots()]]))
        return [fetch_id, False, early]

    def _release_fetch(self, fetch_id: int) -> None:
        fetch = self.leases.take_fetch(fetch_id)
        if fetch is not None:
            fetch.release()

    def _begin_writes(self, keys: list[bytes]) -> list[int | None]:
        slots = self.tiers.begin_writes(keys)
        self.leases.begin_writes(keys, slots)
        return slots

    def _end_writes(self, keys: list[bytes], slots: list[int], oks: list[bool]) -> None:
        ended = self.leases.end_writes(keys, slots, oks)
        if ended[0]:
            self.tiers.end_writes(*ended)


class _NotAttached:
    """An engine's connection before its HELLO: every call but HELLO is refused."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("attach first (HELLO)")


def _peer_process(sock: socket.socket) -> int | None:
    """A pidfd of the process at the socket's other end (``SO_PEERCRED``), None where there is none to open."""
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
