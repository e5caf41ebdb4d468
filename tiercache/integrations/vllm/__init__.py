"""tiercache inside vLLM (the ``vllm`` extra): a KV connector, a secondary tier and CPU-tier eviction policies.

- ``TierCacheConnector`` (``tiercache.integrations.vllm.connector``, vLLM 0.32 and 0.33):
  a ``KVConnectorBase_V1`` that ``vllm serve`` loads with ``"kv_connector": "TierCacheConnector",
  "kv_connector_module_path": "tiercache.integrations.vllm.connector"``; tiercache's CPU tier and
  remotes under vLLM's own prefix cache, on GPU and on vLLM's CPU build.
Two folders, one per way vLLM takes tiercache: ``connector/`` and ``offloading/``.

- ``TierCacheTier`` (vLLM 0.33, ``offloading``): a vLLM ``SecondaryTierManager`` over any tiercache remote
  topology (Redis, Redis Cluster, regional + central with ``force_latest``, file, simulated),
  loaded by vLLM's ``TieringOffloadingSpec`` from ``kv_connector_extra_config.secondary_tiers``
  with ``{"type": "TierCacheTier", "module_path": "tiercache.integrations.vllm", "topology": ...}``.
- ``TierCacheLRU``, ``TierCacheARC``, ``TierCacheS3FIFO``, ``TierCache2Q`` (vLLM 0.33, ``offloading``):
  tiercache's policies as vLLM ``CachePolicy`` classes for its CPU tier
  (``"eviction_policy": "TierCacheS3FIFO", "cache_policy_module_path": "tiercache.integrations.vllm"``).

Each part checks the installed vLLM when it is first used (``version``); another minor release
fails with ``UnsupportedVllmError`` and what to install.
"""

from tiercache.common.exports import lazy_exports
from tiercache.integrations.vllm.version import WRITTEN_FOR, UnsupportedVllmError, require_vllm

_EXPORTS = {
    "TierCacheConnector": "tiercache.integrations.vllm.connector",
    "TierCacheTier": "tiercache.integrations.vllm.offloading.tier",
    "TierCachePolicy": "tiercache.integrations.vllm.offloading.policies",
    "TierCacheLRU": "tiercache.integrations.vllm.offloading.policies",
    "TierCacheARC": "tiercache.integrations.vllm.offloading.policies",
    "TierCacheS3FIFO": "tiercache.integrations.vllm.offloading.policies",
    "TierCache2Q": "tiercache.integrations.vllm.offloading.policies",
}

__all__ = ["WRITTEN_FOR", "UnsupportedVllmError", "require_vllm", *sorted(_EXPORTS)]
__getattr__ = lazy_exports(__name__, _EXPORTS)
