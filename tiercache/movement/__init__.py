"""Data movement: the queues and the runs that move bytes between the tiers, in the background.

``base`` (the interfaces the queues report through: ``Bookkeeper``,
``LinkObserver``), ``runtime`` (the background event loop), ``limiter``
(priorities: loads, then stores, then explorations), ``lanes`` (one transfer
lane per remote tier: limits, deadlines, its breaker), ``reads`` (the one remote
read path), ``presence`` (the presence cache: remote lookups answered from memory),
``mover`` (runs the bookkeeping's moves and reports their outcomes), ``loads`` (streamed loads into the GPU pool and the
prefetch policies), ``explorer`` (the cost model's background fetches),
``transfers`` (the ``Transfer`` handle) and ``swap`` (GPU<->CPU copies, the only
place that branches on the device).

Imports from: ``common``, ``blocks``, ``telemetry``, ``bookkeeping``, ``tiers``.
"""
