"""Test support that ships with tiercache, for its own tests and for third-party tiers.

``conformance``: the remote-tier contract (``tiercache.tiers.base``) as a suite
of checks any ``RemoteTier`` runs, with pytest (subclass ``RemoteTierContract``)
or without (``asyncio.run(check(harness))`` for each of ``CHECKS``).

What tiercache's tests and benchmarks share (so benchmarks import nothing from
``tests/``): ``redis_servers`` (real ``redis-server`` processes and a 3-node
cluster, test blocks), ``policy_traces`` (synthetic key traces and libCacheSim's
oracleGeneral files), ``mrc_reference`` (libCacheSim's exact LRU curve; needs
libcachesim), ``vllm_offloading`` (vLLM's offloading manager driven as its
scheduler does; needs vLLM), ``sglang_parts`` (SGLang's KV pools and storage
factory on CPU; needs SGLang), ``tiny_llama`` (a small Llama built locally), ``real_model`` (SmolLM2-135M-Instruct
converted from the GGUF an installed package ships; needs the ``real`` extra),
``tiny_models`` (small hybrid and
sliding-window models built locally) and
``vllm_server`` (vLLM's OpenAI server as a subprocess; its ``/metrics`` and
streamed answers parsed by ``server_formats``; ``timed_scheduler``, vLLM's
scheduler timing each step and the connector's hooks, read back by
``step_times``) and ``throttled_link`` (a TCP proxy with a slower link's
bandwidth and round trip).

Imports from: ``common``, ``policies``, ``blocks``, ``codecs``, ``telemetry``, ``bookkeeping``, ``tiers``, ``movement``,
``config``, ``remote``, ``manager``.
"""
