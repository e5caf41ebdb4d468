"""What the cache tells operators and routers: counters, Prometheus, the stats server, KV events, MRCs.

``counters`` (``Metrics``: per-tier counters and latency histograms), ``prometheus``
(the exposition of ``stats()``), ``stats_server`` (``stats()`` over HTTP on loopback
and its client), ``observer`` (the bookkeeping's one outlet for what tiers stored,
served and removed), ``mrc`` (live miss-ratio curves) and ``events`` (KV events in
vLLM's wire format, with replay).

Imports from: ``common``, ``blocks``.
"""
