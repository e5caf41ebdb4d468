"""``HostTiers``: an engine's ``LowerTiers`` served by the host cache server, across its Unix socket.

The same calls as ``LowerTiers`` (lookup, ask, flush_presence, forget,
wait_for_answers, release, fetch, begin_writes, end_writes, reset_cpu_tier,
observe_prefill, buffer_view, level_blocks, stats), the same answers, and the
same "ask again": a lookup still waiting for a remote is None. The engine copies
KV straight into and out of the server's region, which the client maps.

A server that is down, restarting or slow is a miss, never an exception: a call
that gets no reply within ``reply_timeout_s`` detaches the client (its pending
fetches end with no slots, its hits read as misses), and a background thread
attaches again every ``retry_s`` (the engine's thread never waits on a
connect). Calls whose reply the engine does not need (releases, ends of writes,
prefill timings) are sent without waiting. The one error raised is at
``start``: a server that holds another model or page format (``HostAttachError``).
A server whose topology names no layout takes this engine's model and layout
if it is the first to attach (``engines``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from tiercache.blocks.keys import BlockHasher
from tiercache.config import TierCacheConfig
from tiercache.host import wire
from tiercache.host.attachment import Attachment, Detached, HostAttachError, ServedFetch, ServedHit, ended_fetch
from tiercache.host.engines import describe
from tiercache.host.region import HostRegion, HostRegionError
from tiercache.host.wire import Op, Status
from tiercache.remote.build import model_namespace

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 0.5
"""A call's bound: a server slower than this is treated as down (the engine serves on, on misses)."""
RETRY_S = 2.0
"""How often a detached client tries to attach again."""


class HostTiers:
    """The tiers below an engine's GPU pool, served by the host server at ``socket_path`` (see the module
    docstring). ``config`` is the engine's topology: its model and layout are what it stores (the server's, or
    given to a server that has none yet); its tiers are the server's business."""

    def __init__(self, config: TierCacheConfig, socket_path: Path, *, reply_timeout_s: float = REPLY_TIMEOUT_S,
                 retry_s: float = RETRY_S) -> None:
        self.config, self.socket_path = config, Path(socket_path)
        self.namespace = model_namespace(config)[0]
        self.block_size = config.layout.block_size
        self.hasher = BlockHasher(self.namespace, self.block_size)
        self.bytes_per_block = config.layout.bytes_per_block
        self.names = [tier.name for tier in config.tiers]
        """Every tier's name, fastest first: the engine's topology's until attached, then the server's."""
        self.types = [tier.type for tier in config.tiers]
        """Every tier's type, as ``names``."""
        self.reply_timeout_s, self.retry_s = reply_timeout_s, retry_s
        self._link: Attachment | None = None
        self._attached = threading.Condition()
        self._closed = False
        self._attacher: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Attach now if the server answers (``HostAttachError``: it holds another model); else serve misses and
        attach in the background once it does."""
        if not self._try_attach(raise_refusal=True):
            self._keep_attaching()

    def close(self) -> None:
        with self._attached:
            self._closed = True
            link, self._link = self._link, None
            self._attached.notify_all()
        if link is not None:
            link.broken("closed")

    @property
    def attached(self) -> bool:
        return self._link is not None

    def wait_attached(self, timeout_s: float) -> bool:
        """Block until attached, at most ``timeout_s`` (tests and tools; an engine never needs to)."""
        with self._attached:
            return self._attached.wait_for(lambda: self._link is not None or self._closed, timeout_s) and \
                self._link is not None

    # ---- the engine's calls ----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], *, local_only: bool = False, asker: Hashable | None = None,
               send: bool = True) -> ServedHit | None:
        """As ``LowerTiers.lookup``; a miss (no blocks) while no server answers."""
        link = self._link
        try:
            found = self._call(link, Op.LOOKUP, [list(keys), local_only, asker, send])
        except Detached:
            return ServedHit(list(keys), [])
        if found is None:
            return None
        hit_id, tiers = found
        return ServedHit(list(keys), list(tiers), hit_id, link if hit_id else None)  # an empty hit is not leased

    def ask(self, keys: Sequence[bytes], asker: Hashable, *, send: bool = True) -> None:
        self._post(Op.ASK, [list(keys), asker, send])

    def flush_presence(self) -> None:
        self._post(Op.FLUSH_PRESENCE, [])

    def forget(self, asker: Hashable) -> None:
        self._post(Op.FORGET, [asker])

    def wait_for_answers(self, timeout_s: float) -> bool:
        """As ``LowerTiers.wait_for_answers``; while detached, waits for an attach instead."""
        link = self._link
        if link is None:
            self.wait_attached(timeout_s)
            return False
        try:
            return bool(link.call(Op.WAIT_FOR_ANSWERS, [timeout_s], timeout_s + self.reply_timeout_s))
        except (Detached, HostAttachError):
            return False

    def release(self, hit: ServedHit) -> None:
        if hit.link is not None and hit.link is self._link:
            with contextlib.suppress(Detached):
                hit.link.post(Op.RELEASE_HIT, [hit.hit_id])

    def fetch(self, hit: ServedHit, count: int | None = None, *, force_latest: bool = False) -> ServedFetch:
        """As ``LowerTiers.fetch``: the slots in the server's region, pinned for this engine until ``release``."""
        link = hit.link
        if link is None or link is not self._link or not hit.num_blocks:
            return ended_fetch()
        try:
            fetch_id, ready, slots = self._call(link, Op.FETCH, [hit.hit_id, count, force_latest])
        except (Detached, TypeError):
            return ended_fetch()
        fetch = ServedFetch(fetch_id, link, list(slots))
        if ready:
            fetch.arrived(list(slots))
        else:
            link.expect(fetch)
        return fetch

    def begin_writes(self, keys: Sequence[bytes]) -> list[int | None]:
        """As ``LowerTiers.begin_writes``; no slots while no server answers."""
        try:
            return list(self._call(self._link, Op.BEGIN_WRITES, [list(keys)]))
        except Detached:
            return [None] * len(keys)

    def end_writes(self, keys: Sequence[bytes], slots: Sequence[int], oks: Sequence[bool]) -> None:
        self._post(Op.END_WRITES, [list(keys), list(slots), [bool(ok) for ok in oks]])

    def reset_cpu_tier(self) -> int:
        """As ``LowerTiers.reset_cpu_tier``, for every engine on the host: the tier is theirs together."""
        try:
            return int(self._call(self._link, Op.RESET_CPU_TIER, []))
        except Detached:
            return 0

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self._post(Op.OBSERVE_PREFILL, [tokens, seconds])

    @property
    def region(self) -> HostRegion | None:
        """The region attached now (its ``token`` and ``slots``; None while detached)."""
        link = self._link
        return None if link is None else link.region

    @property
    def region_token(self) -> bytes:
        """The token of the region attached now (b"" while detached): what the slots of a call made now name."""
        link = self._link
        return b"" if link is None else link.region.token

    def buffer_view(self, slot: int) -> memoryview:
        """The bytes of slot ``slot`` of the region attached now (``HostRegionError`` while detached)."""
        link = self._link
        if link is None:
            raise HostRegionError("not attached to a host server")
        return memoryview(link.region.slots[slot].numpy()).cast("B")

    def level_blocks(self) -> dict[str, int]:
        try:
            return dict(self._call(self._link, Op.LEVEL_BLOCKS, []))
        except Detached:
            return {}

    def stats(self) -> dict[str, Any]:
        """The server's stats (every engine's), with ``host.attached``."""
        try:
            stats = dict(self._call(self._link, Op.STATS, []))
        except Detached:
            return {"host": {"attached": False}}
        stats.setdefault("host", {})["attached"] = True
        return stats

    # ---- the link ---------------------------------------------------------------------------
    def _call(self, link: Attachment | None, op: Op, args: list[Any]) -> Any:
        if link is None:
            raise Detached
        try:
            return link.call(op, args, self.reply_timeout_s)
        except HostAttachError as refused:  # a call the server refused (a bug of ours): a miss, said in the log
            log.warning("tiercache host client: the server refused %s: %s", op.name, refused)
            raise Detached from None

    def _post(self, op: Op, args: list[Any]) -> None:
        link = self._link
        if link is not None:
            with contextlib.suppress(Detached):
                link.post(op, args)

    def _try_attach(self, *, raise_refusal: bool) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.reply_timeout_s)
        try:
            sock.connect(str(self.socket_path))
            wire.send(sock, [1, int(Op.HELLO), [wire.PROTOCOL_VERSION, self.namespace.root(), self.bytes_per_block,
                                                 self.block_size, describe(self.config)]])
            _, status, body = wire.FrameReader(sock).frame()
            if status != Status.OK:
                sock.close()
                refusal = HostAttachError(f"the host server at {self.socket_path} refused this engine: {body}")
                if raise_refusal:
                    raise refusal
                log.error("%s", refusal)
                return False
            region = HostRegion.attach(Path(body["region"]), body["num_slots"], body["slot_bytes"], body["token"])
        except (OSError, wire.WireError, HostRegionError, KeyError, TypeError) as error:
            sock.close()
            log.info("tiercache host client: no host server at %s yet: %s", self.socket_path, error)
            return False
        with self._attached:
            if self._closed:
                sock.close()
                return True
            self._link = Attachment(sock, region, list(body["names"]), self.reply_timeout_s, self._lost)
            self.names, self.types = list(body["names"]), list(body["types"])
            self._attached.notify_all()
        log.info("tiercache host client: attached to %s (region %s)", self.socket_path, region.path)
        return True

    def _lost(self, link: Attachment) -> None:
        with self._attached:
            if self._link is not link:
                return
            self._link = None
        self._keep_attaching()

    def _keep_attaching(self) -> None:
        with self._attached:
            if self._closed or self._attacher is not None:
                return
            self._attacher = threading.Thread(target=self._attach_until_attached, name="tiercache-host-attach",
                                              daemon=True)
            self._attacher.start()

    def _attach_until_attached(self) -> None:
        while True:
            with self._attached:
                if self._closed or self._link is not None:
                    self._attacher = None  # under the lock: a link lost from now on starts another attacher
                    return
            if not self._try_attach(raise_refusal=False):
                with self._attached:
                    self._attached.wait(self.retry_s)
