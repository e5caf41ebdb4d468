"""tiercache under vLLM 0.33's own offloading (``OffloadingConnector`` with ``TieringOffloadingSpec``).

``tier`` (``TierCacheTier``: a tiercache remote topology as a secondary tier under vLLM's CPU tier), ``jobs``
(its transfer jobs, each reported once), ``namespace`` (who shares a chunk: the core's one builder over
vLLM's ``OffloadingConfig``), ``metrics`` (its counters as vLLM offloading metrics) and ``policies``
(tiercache's eviction policies as ``CachePolicy`` classes for vLLM's CPU tier). vLLM loads them by the
package path ``tiercache.integrations.vllm`` (the README's lines), which exports them lazily; each module
checks the installed vLLM first (``tiercache.integrations.vllm.version``).
"""
