"""KV events for KV-aware routers: what each tier holds, as vLLM publishes it.

``config`` (the topology's ``events`` section, no extra needed), ``wire`` (the
message structs in vLLM's format), ``lineage`` (parents and tokens of stored
chains), ``sink`` (the engine-side queue and its background thread) and
``publisher`` (ZeroMQ, with replay). ``wire``, ``sink`` and ``publisher`` need the
``events`` extra (msgspec, pyzmq), so this package imports none of them itself.
"""
