"""The pure bookkeeping wired as the stack wires it, for the step-by-step tests of tests/bookkeeping.

``wire`` builds a ``Hierarchy`` and its ``RemoteWrites`` over real slot tables and LRU policies, sharing
one ``Outbox`` and one set of hit counts; a test drives them the way the manager does and reads the moves
they ask for with ``take``, as vLLM's offloading tests drive its manager without a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.bookkeeping.admission import FillRule, HitCounts, WritePolicy
from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.memory_tiers import MemoryTiers
from tiercache.bookkeeping.moves import Move, Outbox
from tiercache.bookkeeping.remote_writes import RemoteWrites
from tiercache.bookkeeping.slots import SlotTable
from tiercache.policies import make_policy
from tiercache.telemetry.counters import Metrics
from tiercache.telemetry.observer import NullObserver, TierObserver

ADMIT_AFTER_HITS = 2
"""Every tier's ``admit_after_hits`` here: a selective tier admits a block at its second hit."""
BLOCK_SIZE = 2
BYTES_PER_BLOCK = 64


class Removals:
    """An observer that keeps every removal it is told of (what routers would hear)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[bytes]]] = []

    def stored(self, tier: str, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None) -> None:
        return None

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if keys:
            self.seen.append((tier, list(keys)))

    def accessed(self, tier: str, keys: Sequence[bytes]) -> None:
        return None


def key(i: int) -> bytes:
    """A block key (16 bytes, as the hasher's)."""
    return i.to_bytes(16, "little")


@dataclass
class Parts:
    """The bookkeeping of one topology, as the stack holds it."""

    hierarchy: Hierarchy
    remote_writes: RemoteWrites
    local: MemoryTiers
    metrics: Metrics
    outbox: Outbox

    def take(self) -> list[Move]:
        """Every move asked for since the last call, oldest first (the mover's part)."""
        moves = []
        while (move := self.outbox.take()) is not None:
            moves.append(move)
        return moves

    def counters(self, tier: str) -> dict[str, int]:
        return dict(self.metrics.counters.get(tier, {}))


def wire(
    gpu_slots: int | None,
    cpu_slots: int | None,
    cpu_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    lanes: Sequence[WritePolicy] = (),
    *,
    max_pending_stores: int = 64,
    remember_keys: int = 1000,
    exclusive: bool = False,
    observer: TierObserver | None = None,
) -> Parts:
    """A GPU pool (None: the engine keeps its own, named ``engine``), a CPU tier filled by ``cpu_policy`` and one
    remote lane per entry of ``lanes`` (named ``remote0``, ``remote1``, ...), every tier LRU."""
    gpu = SlotTable(gpu_slots, make_policy("lru", gpu_slots)) if gpu_slots else None
    cpu = SlotTable(cpu_slots, make_policy("lru", cpu_slots)) if cpu_slots else None
    local, metrics, outbox, hits = MemoryTiers(gpu, cpu), Metrics(), Outbox(), HitCounts(remember_keys)
    observer = observer or NullObserver()
    rules = [FillRule(f"remote{i}", policy, ADMIT_AFTER_HITS) for i, policy in enumerate(lanes)]
    remote_writes = RemoteWrites(
        cpu, rules, hits, outbox, metrics, observer, cpu_name="cpu", bytes_per_block=BYTES_PER_BLOCK,
        max_pending_stores=max_pending_stores, remember_keys=remember_keys,
    )
    hierarchy = Hierarchy(
        local, FillRule("cpu", cpu_policy, ADMIT_AFTER_HITS) if cpu else None, remote_writes, hits, outbox, metrics,
        observer, gpu_name="gpu" if gpu else "engine", block_size=BLOCK_SIZE, exclusive=exclusive,
    )
    return Parts(hierarchy, remote_writes, local, metrics, outbox)
