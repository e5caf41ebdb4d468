"""Builders for the host server's tests: a topology, started clients, the engine's stores, the server's slots
(``chain`` and ``block_bytes`` are the LowerTiers tests', which work on a ``HostTiers`` too)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from support.lower_tiers_helpers import block_bytes, until  # it needs only a hasher and sizes
from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.host.client import HostTiers
from tiercache.host.server import HostServer

LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "block_size": 2}
"""128 bytes a block."""
WAIT_S = 20.0
"""Bound on background work: a hang detector, never a speed judgement."""


def host_topology(cpu_blocks: int = 8, remotes: Sequence[dict[str, Any]] = (), model: str = "host-tests"
                  ) -> dict[str, Any]:
    return {"model": {"id": model}, "layout": LAYOUT,
            "tiers": [{"type": "cpu", "capacity_blocks": cpu_blocks}, *remotes]}


def host_config(**kwargs: Any) -> TierCacheConfig:
    return config_from_dict(host_topology(**kwargs), environ={}, engine_pool=True)


def write_topology(path: Path, **kwargs: Any) -> Path:
    path.write_text(yaml.safe_dump(host_topology(**kwargs)))
    return path


def client(server_socket: Path, opened: list[HostTiers], config: TierCacheConfig | None = None, **kwargs: Any
           ) -> HostTiers:
    """A started client of the server at ``server_socket``, closed by the test's fixture."""
    tiers = HostTiers(config or host_config(), server_socket, **kwargs)
    opened.append(tiers)
    tiers.start()
    return tiers


def write(tiers: HostTiers, keys: Sequence[bytes]) -> list[int | None]:
    """The engine's store: slots for ``keys``, its copies into them, ``end_writes``, landed on the server."""
    slots = tiers.begin_writes(keys)
    chosen = [(key, slot) for key, slot in zip(keys, slots, strict=True) if slot is not None]
    for key, slot in chosen:
        tiers.buffer_view(slot)[:] = block_bytes(tiers, key)
    tiers.end_writes([k for k, _ in chosen], [s for _, s in chosen], [True] * len(chosen))
    tiers.stats()  # a round trip: the server has ended the writes (its calls are answered in order)
    return slots


def held_slots(server: HostServer) -> int:
    """The server's CPU slots neither free nor evictable: pinned, or being written."""
    assert server.tiers is not None
    occupancy = server.tiers.stats()["tiers"][server.tiers.names[0]]
    return occupancy["capacity_blocks"] - occupancy["free_blocks"] - occupancy["evictable_blocks"]


def cached_blocks(server: HostServer) -> int:
    assert server.tiers is not None
    return server.tiers.stats()["tiers"][server.tiers.names[0]]["cached_blocks"]


def drop_cpu_tier(server: HostServer, blocks: int) -> None:
    """Reset the server's CPU tier until ``blocks`` were dropped (a block goes once its remote puts landed)."""
    assert server.tiers is not None
    tiers, dropped = server.tiers, [0]

    def dropped_all() -> bool:
        dropped[0] += tiers.reset_cpu_tier()
        return dropped[0] >= blocks

    until(dropped_all)
