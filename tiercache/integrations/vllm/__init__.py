"""tiercache inside vLLM 0.33 (the ``vllm`` extra): a secondary tier and CPU-tier eviction policies.

- ``TierCacheTier``: a vLLM ``SecondaryTierManager`` over any tiercache remote
  topology (Redis, Redis Cluster, regional + central with ``force_latest``,
  file, simulated), loaded by vLLM's ``TieringOffloadingSpec`` from
  ``kv_connector_extra_config.secondary_tiers`` with
  ``{"type": "TierCacheTier", "module_path": "tiercache.integrations.vllm", "topology": ...}``.
- ``TierCacheLRU``, ``TierCacheARC``, ``TierCacheS3FIFO``, ``TierCache2Q``:
  tiercache's policies as vLLM ``CachePolicy`` classes for its CPU tier
  (``"eviction_policy": "TierCacheS3FIFO", "cache_policy_module_path": "tiercache.integrations.vllm"``).

Written for vLLM 0.33.0; importing it with another vLLM minor release fails
with ``UnsupportedVllmError`` (see ``version``).
"""

from tiercache.integrations.vllm.version import WRITTEN_FOR, UnsupportedVllmError, require_vllm

require_vllm()

from tiercache.integrations.vllm.policies import (  # noqa: E402  (after the version check)
    TierCache2Q,
    TierCacheARC,
    TierCacheLRU,
    TierCachePolicy,
    TierCacheS3FIFO,
)
from tiercache.integrations.vllm.tier import TierCacheTier  # noqa: E402

__all__ = [
    "WRITTEN_FOR",
    "TierCache2Q",
    "TierCacheARC",
    "TierCacheLRU",
    "TierCachePolicy",
    "TierCacheS3FIFO",
    "TierCacheTier",
    "UnsupportedVllmError",
    "require_vllm",
]
