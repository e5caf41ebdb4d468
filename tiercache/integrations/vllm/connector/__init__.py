"""tiercache as a vLLM KV connector: ``"kv_connector": "TierCacheConnector",
"kv_connector_module_path": "tiercache.integrations.vllm.connector"`` (vLLM 0.32 and 0.33).

``connector`` (the class vLLM loads: a role switch with every hook guarded),
``scheduler`` (the scheduler side: ``LowerTiers``, lookups, load and store jobs),
``requests`` (what it keeps per request, by phase: keys, lookup, fetch, stores),
``jobs`` (loads and stores sent to the workers, until all reported them),
``worker`` (the worker side: each step's copies, layer by layer; ``step_store``,
its share of a step's stores; ``host_mapping``, the host cache server's region
it maps with the ``host`` option),
``region`` (the CPU tier's memory, shared between vLLM's processes) and
``shmfile`` (its file: room checked and allocated, held while workers live,
stale ones removed),
``geometry`` (how a slot holds a vLLM block of each KV-cache group),
``namespace`` (who shares a slot: the model's identity and the page format),
``groups`` (what a hit needs and a store keeps of each KV-cache group),
``token_order`` (where the attention backend keeps each token's K and V: the
compact level's token map, read from vLLM's CPU kernel itself),
``options`` (``kv_connector_extra_config``), ``metadata`` (the jobs sent each
step and the reports back) and ``metrics`` (vLLM's connector stats and
Prometheus counters); ``geometry``, ``pages``, ``transfers``, ``staged``,
``pinning`` (host memory registered as pinned), ``cudart`` (the CUDA runtime calls
torch lacks), ``region`` and ``shmfile`` (the worker's page map, transfer engines
and region), and ``worker`` with ``metadata``, ``token_order``, ``step_store`` and
``host_mapping`` (which imports the host client only when the option is set), need torch
only, not vLLM, YAML or the namespace's hashing (``scripts/gpu_check_connector.sh``
runs them on a GPU machine without vLLM), so the class is imported on first use,
after the installed vLLM's version is checked.
"""

from typing import Any

from tiercache.integrations.vllm.version import CONNECTOR_SERIES, require_vllm

__all__ = ["TierCacheConnector"]


def __getattr__(name: str) -> Any:
    """``TierCacheConnector``, once the installed vLLM is one it is written for (``UnsupportedVllmError``)."""
    if name != "TierCacheConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_vllm(CONNECTOR_SERIES, "TierCacheConnector (tiercache.integrations.vllm.connector)")
    from tiercache.integrations.vllm.connector.connector import TierCacheConnector

    return TierCacheConnector
