"""Tools built on the library, not part of it.

The demo's toy engine, the simulator and its workload, and a reference
transformer; the command line (``tiercache.cli``) runs them. No core module
imports this package.

Imports from: ``common``, ``policies``, ``blocks``, ``telemetry``, ``bookkeeping``, ``tiers``, ``movement``,
``config``, ``remote``, ``manager``.
"""
