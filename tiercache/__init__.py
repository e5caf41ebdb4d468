"""tiercache: a tiered KV-cache store (GPU pool, pinned CPU, remote stores) for LLM engines."""

from __future__ import annotations

from tiercache.common.exports import lazy_exports

_EXPORTS = {
    "BlockHasher": "tiercache.blocks.keys",
    "Namespace": "tiercache.blocks.keys",
    "PageFormat": "tiercache.blocks.namespaces",
    "engine_namespace": "tiercache.blocks.namespaces",
    "KVLayout": "tiercache.blocks.layout",
    "PageLayout": "tiercache.blocks.layout",
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
    "LowerTiers": "tiercache.manager.lower_tiers",
    "Lookup": "tiercache.manager",
    "Transfer": "tiercache.manager",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
"""Public names imported on first use, so ``import tiercache.policies`` stays light."""
