"""Small builders shared by the manager tests: tiny layouts, topologies and a toy engine."""

from __future__ import annotations

from typing import Any

from tiercache.config import TierCacheConfig, config_from_dict

TINY_LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "block_size": 2}


def topology(
    gpu_blocks: int = 6,
    cpu_blocks: int | None = 10,
    *,
    layout: dict[str, Any] | None = None,
    cpu: dict[str, Any] | None = None,
    remotes: list[dict[str, Any]] | None = None,
    **top: Any,
) -> TierCacheConfig:
    """A validated config with a CPU-device GPU pool, an optional CPU tier and remotes."""
    tiers: list[dict[str, Any]] = [
        {"type": "gpu", "capacity_blocks": gpu_blocks, "options": {"device": "cpu"}},
    ]
    if cpu_blocks is not None:
        tiers.append({"type": "cpu", "capacity_blocks": cpu_blocks, **(cpu or {})})
    tiers.extend(remotes or [])
    data = {"model": {"id": "test-model"}, "layout": layout or TINY_LAYOUT, "tiers": tiers, **top}
    return config_from_dict(data, environ={})
