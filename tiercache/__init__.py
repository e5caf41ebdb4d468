"""tiercache: a tiered KV-cache store (GPU pool, pinned CPU, remote stores) for LLM engines."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockHasher": "tiercache.blocks.keys",
    "Namespace": "tiercache.blocks.keys",
    "KVLayout": "tiercache.blocks.layout",
    "MemoryOrder": "tiercache.blocks.layout",
    "UnsupportedModelError": "tiercache.blocks.layout",
    "PagedKV": "tiercache.blocks.paged",
    "blocks_needed": "tiercache.blocks.paged",
    "RemoteStore": "tiercache.remote.store",
    "CapacityError": "tiercache.manager",
    "ConfigError": "tiercache.config",
    "TierCacheConfig": "tiercache.config",
    "load_config": "tiercache.config",
    "TierManager": "tiercache.manager",
    "Lookup": "tiercache.manager",
    "Transfer": "tiercache.manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use, so ``import tiercache.policies`` stays light."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
