"""``HostServer``: one ``LowerTiers`` for every engine on a host, behind a Unix socket (``tiercache serve``).

The server owns the CPU tier's memory (a ``HostRegion`` in shared memory), its
index, policy and write policies, and the remotes below it. Engines attach over
the socket (``client.HostTiers``) and make the calls they make of a
``LowerTiers`` of their own; KV bytes never cross the socket: engines copy
between their pages and the region's slots, which they map.

Each attached engine has a connection thread that answers its calls in order
(none to a call of id 0) and a writer thread that sends the events the server
pushes (a fetch that arrived), so an engine that stops reading stalls only its
own threads, never the background loop that every engine shares. What an engine
holds is leased (``leases``): when its connection ends, however it ends, the
server releases its hits and fetches and fails the writes it had not ended.
Only who may open the socket may attach: it is made owner- and group-only
(``SOCKET_MODE``), with ``group`` to name another group. See
``docs/architecture.md``, "The host cache server".
"""

from __future__ import annotations

import contextlib
import grp
import itertools
import json
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.host import wire
from tiercache.host.engines import adopt, check_tiers, needs_engine
from tiercache.host.leases import Leases
from tiercache.host.region import HostRegion
from tiercache.host.wire import Event, Op, Status
from tiercache.manager.lower_tiers import HostFetch, HostHit, LowerTiers

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
"""Owner and group may attach (the region's file has the same mode)."""
LISTEN_BACKLOG = 64
LEASE_GRACE_S = 10.0
"""How long the leases of an engine whose connection ended but whose process lives are kept: its workers may be
copying out of slots it fetched (a client that timed out detaches, then attaches anew). A dead one's go at once."""
SEND_TIMEOUT_S = 5
"""A send to an engine that does not read for this long ends its connection (its leases then wait out the grace)."""
GRACE_POLL_S = 0.2
"""How often a connection waiting out its engine's grace checks whether the server stops."""
MAX_WAIT_FOR_ANSWERS_S = 1.0
"""Bound on one ``WAIT_FOR_ANSWERS`` call, whatever the engine asked (it holds that engine's connection)."""


class HostServer:
    """The host cache server (see the module docstring); ``start`` then ``close``, or a ``with`` block."""

    def __init__(self, topology: TierCacheConfig | Mapping[str, Any], socket_path: Path, *,
                 source: str = "<topology>", shared_dir: Path = Path("/dev/shm"), group: str | None = None,
                 lease_grace_s: float = LEASE_GRACE_S) -> None:
        self.socket_path, self.shared_dir, self.group = Path(socket_path), Path(shared_dir), group
        self.lease_grace_s = lease_grace_s
        self._topology, self._source = topology, source
        self.config: TierCacheConfig | None = None
        """The topology served (None until the first engine attaches, for a topology without a layout)."""
        if isinstance(topology, TierCacheConfig):
            self.config = topology
        elif needs_engine(topology):
            check_tiers(topology, source)
        else:
            self.config = config_from_dict(topology, source, engine_pool=True)
        self.region: HostRegion | None = None
        self.tiers: LowerTiers | None = None
        self._listener: socket.socket | None = None
        self._connections: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._building = threading.Lock()
        self._closed = threading.Event()

    def start(self) -> HostServer:
        """Make the region and start the tiers (at once, or when the first engine says its model and layout),
        listen (an error if another server answers on the socket)."""
        if self.socket_path.exists():
            _remove_stale_socket(self.socket_path)
        try:
            if self.config is not None:
                self._build(self.config)
            self._listener = self._listen()
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._accept, name="tiercache-host-accept", daemon=True).start()
        return self

    def tiers_for(self, description: Mapping[str, Any]) -> LowerTiers:
        """The tiers, built for this engine's model and layout if none are yet (``ConfigError``: it cannot be)."""
        with self._building:
            if self.tiers is None:
                assert not isinstance(self._topology, TierCacheConfig)
                self.config = adopt(self._topology, self._source, description)
                self._build(self.config)
            assert self.tiers is not None
            return self.tiers

    def _build(self, config: TierCacheConfig) -> None:
        region = HostRegion.create(self.shared_dir, *_slot_geometry(config))
        try:
            tiers = LowerTiers(config, cpu_buffer=region.slots)
            tiers.start()
        except BaseException:
            region.close()
            raise
        if self.group is not None:
            os.chown(region.path, -1, grp.getgrnam(self.group).gr_gid)
        self.region, self.tiers = region, tiers
        log.info("tiercache host server: %s, model %s, region %s (%d slots of %d bytes)", self.socket_path,
                 config.model.id, region.path, region.num_slots, region.slot_bytes)

    def close(self) -> None:
        """Stop accepting, end every connection (their leases taken back), close the tiers, remove the files."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
            self.socket_path.unlink(missing_ok=True)
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.shut()
        for connection in connections:
            connection.thread.join(timeout=5)
        if self.tiers is not None:
            self.tiers.close()
        if self.region is not None:
            self.region.close()

    def __enter__(self) -> HostServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait(self) -> None:
        """Block until ``close`` (``tiercache serve``'s main thread)."""
        self._closed.wait()

    def stats(self) -> dict[str, Any]:
        """The tiers' stats, the engines attached, and the leases of each (those of engines gone, in their grace,
        too)."""
        with self._lock:
            connections = list(self._connections.values())
        leases = {str(c.id): c.leases.counts() for c in connections}
        tiers = self.tiers.stats() if self.tiers is not None else {"tiers": {}}
        return {**tiers, "host": {"engines": sum(not c.ended for c in connections), "leases": leases}}

    # ---- connections ----------------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o777 & ~SOCKET_MODE)  # born owner- and group-only: no moment when others may connect
        try:
            listener.bind(str(self.socket_path))
        finally:
            os.umask(umask)
        os.chmod(self.socket_path, SOCKET_MODE)
        if self.group is not None:
            os.chown(self.socket_path, -1, grp.getgrnam(self.group).gr_gid)
        listener.listen(LISTEN_BACKLOG)
        return listener

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                connection = _Connection(self, next(self._ids), sock)
            except OSError as error:  # that engine's socket, not the server's
                log.warning("tiercache host server: an engine's connection failed: %s", error)
                sock.close()
                continue
            with self._lock:  # ``close`` joins every connection it finds: each is started when found
                if self._closed.is_set():
                    connection.abandon()
                    return
                self._connections[connection.id] = connection
                connection.thread.start()

    def _ended(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.pop(connection.id, None)


class _Connection:
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
            self.server._ended(self)

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
        while not self.server._closed.is_set() and (left := deadline - time.monotonic()) > 0:
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
    def _asker(self, asker: Any) -> Hashable | None:
        if asker is None:
            return None
        key = (self.id, asker if isinstance(asker, (str, int)) else str(asker))
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
        key = (self.id, asker if isinstance(asker, (str, int)) else str(asker))
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


def _slot_geometry(config: TierCacheConfig) -> tuple[int, int]:
    """The CPU tier's slot count and slot bytes for the region."""
    if not config.tiers or config.tiers[0].type != "cpu":
        raise ValueError("a host server's topology starts with its CPU tier (config_from_dict(..., engine_pool=True))")
    return config.tiers[0].capacity_blocks, config.layout.bytes_per_block


def _peer_process(sock: socket.socket) -> int | None:
    """A pidfd of the process at the socket's other end (``SO_PEERCRED``), None where there is none to open."""
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket no server answers on (a server killed outright); refuse one that answers."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another tiercache host server answers on {path}")
