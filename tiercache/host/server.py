"""``HostServer``: one ``LowerTiers`` for every engine on a host, behind a Unix socket (``tiercache serve``).

The server owns the CPU tier's memory (a ``HostRegion`` in shared memory), its
index, policy and write policies, and the remotes below it. Engines attach over
the socket (``client.HostTiers``) and make the calls they make of a
``LowerTiers`` of their own; KV bytes never cross the socket: engines copy
between their pages and the region's slots, which they map.

Each attached engine is an ``EngineConnection`` (``connection``): its calls
answered in order by a thread of its own, what it holds leased and taken back
when it goes away, however it goes.
Only who may open the socket may attach: it is made owner- and group-only
(``SOCKET_MODE``), with ``group`` to name another group. See
``docs/architecture.md``, "The host cache server".
"""

from __future__ import annotations

import grp
import itertools
import logging
import os
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.host.connection import EngineConnection
from tiercache.host.engines import adopt, check_tiers, needs_engine
from tiercache.host.region import HostRegion
from tiercache.manager.lower_tiers import LowerTiers

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
"""Owner and group may attach (the region's file has the same mode)."""
LISTEN_BACKLOG = 64
LEASE_GRACE_S = 10.0
"""How long the leases of an engine whose connection ended but whose process lives are kept: its workers may be
copying out of slots it fetched (a client that timed out detaches, then attaches anew). A dead one's go at once."""


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
        self._connections: dict[int, EngineConnection] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._building = threading.Lock()
        self.stopping = threading.Event()
        """Set by ``close``: connections waiting out an engine's grace take its leases back at once."""

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
        self.stopping.set()
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
        self.stopping.wait()

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
        while not self.stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                connection = EngineConnection(self, next(self._ids), sock)
            except OSError as error:  # that engine's socket, not the server's
                log.warning("tiercache host server: an engine's connection failed: %s", error)
                sock.close()
                continue
            with self._lock:  # ``close`` joins every connection it finds: each is started when found
                if self.stopping.is_set():
                    connection.abandon()
                    return
                self._connections[connection.id] = connection
                connection.thread.start()

    def ended(self, connection: EngineConnection) -> None:
        """A connection is over and its leases taken back: forgotten."""
        with self._lock:
            self._connections.pop(connection.id, None)


def _slot_geometry(config: TierCacheConfig) -> tuple[int, int]:
    """The CPU tier's slot count and slot bytes for the region."""
    if not config.tiers or config.tiers[0].type != "cpu":
        raise ValueError("a host server's topology starts with its CPU tier (config_from_dict(..., engine_pool=True))")
    return config.tiers[0].capacity_blocks, config.layout.bytes_per_block


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
