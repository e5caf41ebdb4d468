"""tiercache as a vLLM KV connector: ``"kv_connector": "TierCacheConnector",
"kv_connector_module_path": "tiercache.integrations.vllm.connector"`` (vLLM 0.32 and 0.33).

``connector`` (the class vLLM loads: a role switch with every hook guarded),
``scheduler`` (the scheduler side: ``LowerTiers``, lookups, load and store jobs),
``worker`` and ``pages`` (the worker side: page copies, layer by layer),
``region`` (the CPU tier's memory, shared between vLLM's processes),
``identity`` (the slot geometry and namespace both sides derive from vLLM's
configs), ``groups`` (what a hit needs and a store keeps of each KV-cache
group), ``options`` (``kv_connector_extra_config``), ``metadata`` (the jobs
sent each step and the reports back) and ``stats`` (vLLM's connector stats and
Prometheus counters).
"""

from tiercache.integrations.vllm.version import CONNECTOR_SERIES, require_vllm

require_vllm(CONNECTOR_SERIES, "TierCacheConnector (tiercache.integrations.vllm.connector)")

from tiercache.integrations.vllm.connector.connector import TierCacheConnector  # noqa: E402 (after the check)

__all__ = ["TierCacheConnector"]
