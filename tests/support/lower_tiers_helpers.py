"""Builders for the ``LowerTiers`` tests: topologies under an engine's own pool, the engine's copies, waits."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.manager.lower_tiers import HostHit, LowerTiers
from tiercache.tiers.simulated import SimulatedOptions, SimulatedStore, SimulatedTier

LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "block_size": 2}
"""128 bytes a block."""
WAIT_S = 20.0
"""Bound on background work: a hang detector, never a speed judgement."""
_stores = itertools.count()


def store_name() -> str:
    """A fresh simulated store's name (named stores live for the process)."""
    return f"lower-tiers-{next(_stores)}"


def simulated(store: str, **options: Any) -> dict[str, Any]:
    """A simulated remote over the named ``store`` (no added latency unless asked)."""
    return {"type": "simulated", "name": "sim", "options": {"store": store, "latency_ms": 0, **options}}


def lower_config(cpu_blocks: int = 4, remotes: Sequence[dict[str, Any]] = (), **cpu: Any) -> TierCacheConfig:
    """A topology under an engine's own GPU pool: a CPU tier of ``cpu_blocks`` slots, then ``remotes``."""
    data = {"model": {"id": "lower-tiers"}, "layout": LAYOUT,
            "tiers": [{"type": "cpu", "capacity_blocks": cpu_blocks, **cpu}, *remotes]}
    return config_from_dict(data, environ={}, engine_pool=True)


def started(config: TierCacheConfig, opened: list[LowerTiers], **kwargs: Any) -> LowerTiers:
    """A started ``LowerTiers``, added to ``opened`` (closed by the test's fixture)."""
    tiers = LowerTiers(config, **kwargs)
    opened.append(tiers)
    tiers.start()
    return tiers


def chain(tiers: LowerTiers, blocks: int, salt: int) -> list[bytes]:
    """The keys of a ``blocks``-block prompt (``salt`` makes another prompt)."""
    tokens = [salt * 10_000 + i for i in range(blocks * tiers.block_size)]
    return tiers.hasher.keys(tokens)


def block_bytes(tiers: LowerTiers, key: bytes) -> bytes:
    """The KV an engine computed for the block ``key`` (derived from the key)."""
    return hashlib.shake_256(key).digest(tiers.bytes_per_block)


def slot_bytes(tiers: LowerTiers, slot: int) -> bytes:
    return bytes(tiers.buffer_view(slot))


def write(tiers: LowerTiers, keys: Sequence[bytes], ok: bool = True) -> list[int | None]:
    """The engine's store: CPU slots for ``keys``, its copies into them, ``end_writes``; returns the slots."""
    slots = tiers.begin_writes(keys)
    chosen = [(key, slot) for key, slot in zip(keys, slots, strict=True) if slot is not None]
    for key, slot in chosen:
        tiers.buffer_view(slot)[:] = block_bytes(tiers, key)
    tiers.end_writes([k for k, _ in chosen], [s for _, s in chosen], [ok] * len(chosen))
    return slots


def until(condition: Callable[[], Any], wait_s: float = WAIT_S) -> Any:
    """Poll ``condition`` until it is truthy and return it; fail after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.002)
    return value


def settled_lookup(tiers: LowerTiers, keys: Sequence[bytes]) -> HostHit:
    """Ask again while a remote's answer is in flight, as a scheduler does."""
    return until(lambda: tiers.lookup(keys))


def cpu_occupancy(tiers: LowerTiers) -> dict[str, int]:
    return tiers.stats()["tiers"][tiers.names[0]]


def held_slots(tiers: LowerTiers) -> int:
    """CPU slots neither free nor evictable: pinned, or being written."""
    occupancy = cpu_occupancy(tiers)
    return occupancy["capacity_blocks"] - occupancy["free_blocks"] - occupancy["evictable_blocks"]


def remote(tiers: LowerTiers) -> SimulatedTier:
    """The first remote of a topology, a simulated one."""
    tier = tiers.parts.remotes[0]
    assert isinstance(tier, SimulatedTier)
    return tier


def stored(name: str) -> dict[bytes, bytes]:
    """What a named simulated store holds."""
    return SimulatedStore.named(name, SimulatedOptions()).data
