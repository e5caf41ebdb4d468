"""The contract of tiers below the pinned-CPU swap space (Redis, files, simulated, regional, and plug-ins).

A remote tier is a key-value store of whole blocks. What every remote must do,
and what this base does for it:

- **Results are values.** Its methods are coroutines that never block the event
  loop and never raise on the data path: a failure of any kind (refused, timed
  out, garbage, wrong namespace) is a miss, a failed write or an unknown
  presence in the returned list, and is counted in ``stats()``.
- **Presence is three-valued.** ``contains`` answers ``Presence.UNKNOWN`` where
  the tier could not tell (timeout, breaker open, error): never ``ABSENT``.
- **Validation before use.** Values carry the ``tiercache.blocks.codec`` header; a read
  reports True only for a value that passed the codec's checks (header, key,
  namespace, lengths, checksum or MAC). A False read leaves its buffer
  unspecified; the caller uses no byte of it, and the other keys of the batch
  are served as if it were not there.
- **Removal only of what is provably damaged.** A read reports each value that
  failed to ``self.invalid_values`` (``invalid_values.InvalidValues``), which
  removes the damaged ones in the background through ``delete_damaged`` and
  leaves the rest (another namespace or secret, an unknown format).
- **Named counters.** ``stats()`` (here) is the tier's own ``tier_stats()``,
  which must count ``hits``, ``misses``, ``bytes_read`` and ``bytes_written``,
  plus ``invalid_deleted``, ``invalid_kept``, ``invalid_delete_skipped`` and,
  once anything failed, ``last_error`` (the latest failure with its cause, set
  through ``note_error``; ``tiercache inspect`` prints it).
- **Bounded close.** ``close`` returns within a bound whatever the store does;
  the base stops the background removals within ``CLEANUP_CLOSE_S``.
- **Servers checked apart.** ``check_reachability`` (``tiercache inspect``)
  answers for each server of a tier with several (a cluster's nodes, the
  regional tier's central and region), so one that fails shows even when the
  tier as a whole still answers; a tier with one server answers nothing apart
  (the default), its own calls speak for that server.
- **One breaker, the lane's.** The engine reaches a remote tier through one
  transfer lane (``tiercache.movement.lanes``), whose circuit breaker is the
  tier's: it sees every call and its deadline. ``breaker_settings`` configures
  it (None: the lane's defaults). The lane counts a call failed when it raised,
  passed its deadline, or the tier said during it that its server failed
  (``server_failed``: refused, reset, timed out; a miss or a bad value is no
  failure). A tier keeps breakers of its own only where it has several servers
  and must route around one while it still serves the others.

A new remote tier is a subclass in its own module (or package); a topology
names it by registered type or by module path (``type: mypkg.tiers:S3Tier``).
``tiercache.testing.conformance`` checks all of the above for any tier.

A store that drops blocks by itself (its own eviction, expiry or clean-up) says
so through ``report_evicted``, so the manager forgets them and KV-aware routers
hear of it; ``Capabilities.reports_evictions`` says whether a tier does (where
it does not, what routers are told about that tier is best effort).
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from tiercache.blocks.codec import Codec
from tiercache.tiers.invalid_values import InvalidValues

CLEANUP_CLOSE_S = 1.0
"""How long ``close`` lets background removals of damaged values finish before abandoning them."""
HITS = "hits"
"""Stats name: keys read and validated into their buffers."""
MISSES = "misses"
"""Stats name: keys read that were not served (absent, invalid, failed)."""
BYTES_READ = "bytes_read"
"""Stats name: payload bytes served by reads."""
BYTES_WRITTEN = "bytes_written"
"""Stats name: bytes stored by writes."""
LAST_ERROR = "last_error"
"""Stats name: the latest failure, with its cause (text; present once anything failed)."""
COUNTED_BY_THE_TIER = (HITS, MISSES, BYTES_READ, BYTES_WRITTEN)
"""What every ``tier_stats()`` must hold."""
GET_HIT = "get_hit"
"""The ``<op>_<outcome>`` count of reads served, for tiers that count outcomes so (``outcome_stats``)."""


def known_checksums(checksums: Sequence[int | None] | None, count: int) -> Sequence[int | None]:
    """The ``checksums`` a ``put`` was given, or ``count`` unknowns."""
    return [None] * count if checksums is None else checksums


def outcome_stats(counts: Mapping[str, int]) -> dict[str, float]:
    """``tier_stats`` of a tier that counts ``<op>_<outcome>`` per key and ``bytes_read``/``bytes_written``:
    every count, plus hits and misses derived from the ``get_`` outcomes."""
    out = {name: float(count) for name, count in counts.items()}
    hits = counts.get(GET_HIT, 0)
    out[HITS] = float(hits)
    out[MISSES] = float(sum(count for name, count in counts.items() if name.startswith("get_")) - hits)
    out[BYTES_READ] = float(counts.get(BYTES_READ, 0))
    out[BYTES_WRITTEN] = float(counts.get(BYTES_WRITTEN, 0))
    return out


class Presence(enum.Enum):
    """Whether a remote tier holds a key: three answers, because "could not tell" is not "not held"."""

    HELD = "held"
    ABSENT = "absent"
    """The tier answered, and does not hold the key."""
    UNKNOWN = "unknown"
    """No answer (timeout, breaker open, connection error, garbage): neither a hit nor evidence of removal."""

    @staticmethod
    def of(held: bool) -> Presence:
        """The answer of a tier that did reply."""
        return Presence.HELD if held else Presence.ABSENT


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do, so the manager need not special-case tier types."""

    shared: bool = True
    """Other engines (processes, hosts) see what this tier stores."""
    versioned: bool = False
    """Reads honour ``force_latest`` against a central version."""
    persistent: bool = False
    """Entries survive a restart of the store."""
    takes_checksums: bool = False
    """``put`` accepts ``checksums``: the payloads' checksums a writer already has, so the tier does not hash
    every byte again on the write path (a plug-in without it is called as before)."""
    reports_evictions: bool = False
    """The tier calls ``report_evicted`` for blocks its store drops by itself; without it, what routers are
    told about this tier is best effort (a block the store dropped stays announced until a read misses it)."""


@dataclass(frozen=True)
class BreakerSettings:
    """How the breaker of a tier's lane is set (``tiercache.common.breaker.CircuitBreaker``)."""

    failures: int
    """Consecutive failed calls after which the lane answers misses at once."""
    backoff_s: float
    """First back-off; it doubles per failed trial call up to ``backoff_max_s``."""
    backoff_max_s: float


@dataclass
class CallReport:
    """What a tier said about one call beside its per-key results (see ``report_calls_into``)."""

    server_failed: str | None = None
    """The cause, when the tier's server failed during the call (None: it answered)."""


_CALL_REPORT: ContextVar[CallReport | None] = ContextVar("tiercache_tier_call_report", default=None)


def report_calls_into(report: CallReport) -> None:
    """Make ``server_failed`` of the calls the current task makes from now on write into ``report``.

    The lane calls it in the task that runs one tier call (tasks the tier starts
    from there share it); outside such a task ``server_failed`` tells nobody.
    """
    _CALL_REPORT.set(report)


EvictionListener = Callable[[Sequence[bytes]], None]
"""Told the keys a remote store dropped by itself; called from any thread, must not block."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerReachability:
    """One server of a tier, checked on its own (``RemoteTier.check_reachability``)."""

    role: str
    """What the server is to its tier: ``central``, ``region``, a cluster's ``node``."""
    where: str
    """Its address, without credentials."""
    ok: bool
    detail: str
    """What worked, or why it failed."""


@dataclass(frozen=True)
class RemoteContext:
    """What every remote tier is built with besides its own options."""

    name: str
    codec: Codec
    block_bytes: int


class RemoteTier(ABC):
    """A block store addressed by key; async, batched, failures as values (see the module docstring)."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type | None] = None
    """Dataclass of this tier's YAML ``options`` (config validation builds it); None: the tier takes none."""
    _eviction_listeners: tuple[EvictionListener, ...] = ()

    def __init__(self, context: RemoteContext, options: Any) -> None:
        self.name = context.name
        self.codec = context.codec
        self.block_bytes = context.block_bytes
        self.options = options
        self.invalid_values = InvalidValues(context.name, self.delete_damaged)
        """Judges and removes the values reads found invalid (``report`` them there)."""
        self._last_error: str | None = None

    @property
    def last_error(self) -> str | None:
        """The latest failure with its cause (``connect: [Errno 111] Connection refused``), None until one."""
        return self._last_error

    def note_error(self, error: str) -> None:
        """Remember a failure for ``last_error`` (called on the event loop, or from one I/O thread at a time)."""
        self._last_error = error

    def breaker_settings(self) -> BreakerSettings | None:
        """How the breaker of this tier's lane is set; None (the default): the lane's defaults."""
        return None

    def server_failed(self, cause: str) -> None:
        """For tiers, on the event loop, inside a data-path call: the server failed it (refused, reset, timed
        out), so the lane counts the call as a failure for the tier's breaker. Not for misses or bad values."""
        report = _CALL_REPORT.get()
        if report is not None:
            report.server_failed = cause

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect or prepare; an unreachable store is not an error (it reads as misses)."""

    async def close(self) -> None:
        """Release connections and background tasks, within a bound; an override calls ``super().close()``."""
        await self.invalid_values.close(CLEANUP_CLOSE_S)

    async def settle(self) -> None:
        """Wait for the background removals of damaged values started so far."""
        await self.invalid_values.settle()

    async def delete_damaged(self, items: list[Any]) -> int:
        """Remove values that reads proved damaged (the items reported); how many were removed.

        The default deletes the reported keys with ``delete`` (and counts each
        one); a tier that can do better (compare-and-delete, a versioned
        tombstone) overrides it and reports richer items.
        """
        await self.delete(items)
        return len(items)

    async def check_reachability(self, key: bytes) -> list[ServerReachability]:
        """After ``start``: each of the tier's servers checked on its own with ``key`` (written, read and deleted
        where the check writes), for ``tiercache inspect``. The default, for a tier with one server: none apart."""
        return []

    def on_evicted(self, listener: EvictionListener) -> None:
        """Call ``listener(keys)`` whenever the store drops keys by itself (see ``report_evicted``)."""
        self._eviction_listeners = (*self._eviction_listeners, listener)

    def report_evicted(self, keys: Sequence[bytes]) -> None:
        """For tiers: the store dropped ``keys`` by itself (eviction, expiry, clean-up); tells every listener.

        Call it from any thread, never for a delete the manager asked for. A failing
        listener is logged, never raised into the tier.
        """
        if not keys:
            return
        for listener in self._eviction_listeners:
            try:
                listener(keys)
            except Exception:
                log.exception("tier %s: an eviction listener failed", self.name)

    @abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        """Whether each key is stored; ``Presence.UNKNOWN`` where a failure kept the tier from telling."""

    @abstractmethod
    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        """Read and validate each key into its ``dests`` buffer; True where it was filled.

        A False entry leaves its buffer in an unspecified state; the caller must not
        use it.
        """

    @abstractmethod
    async def put(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, checksums: Sequence[int | None] | None = None
    ) -> list[bool]:
        """Store each payload (the caller keeps the buffers alive until this returns).

        ``checksums`` (only for tiers that declare ``takes_checksums``): each payload's
        ``value_format.payload_checksum`` where the caller knows it, None where it does not.
        """

    @abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove keys; missing keys and failures are ignored."""

    @abstractmethod
    def tier_stats(self) -> dict[str, float]:
        """The tier's counters: ``hits``, ``misses``, ``bytes_read``, ``bytes_written``, and its own."""

    def stats(self) -> dict[str, float | str]:
        """The tier's counters, the contract's (invalid values) and ``last_error`` once anything failed."""
        out: dict[str, float | str] = dict(self.tier_stats())
        out.update(self.invalid_values.stats())
        if self._last_error is not None:
            out[LAST_ERROR] = self._last_error
        return out
