"""Adapters between tiercache and model libraries; each imports its library only when it is used.

``tiercache.integrations.transformers`` (the ``hf`` extra): a Hugging Face
``transformers`` cache whose K/V live in the tiercache pool, and a driver that
serves a request the way an engine does (lookup, allocate, load, prefill the
uncached suffix, store, decode, release).
``tiercache.integrations.vllm`` (the ``vllm`` extra): a KV connector that ``vllm
serve`` loads (vLLM 0.32's CPU build and 0.33), a secondary tier for vLLM 0.33's
offloading tiers, and eviction policies for its CPU tier.
``tiercache.integrations.sglang`` (the ``sglang`` extra): a HiCache storage backend.

Imports from: ``common``, ``policies``, ``blocks``, ``codecs``, ``telemetry``, ``bookkeeping``, ``tiers``, ``movement``,
``config``, ``remote``, ``manager``, ``host``.
"""
