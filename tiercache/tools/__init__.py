"""Tools built on the library, not part of it.

The demo's toy engine and its chat on a trained model (``chat_demo``: the
model is handed in, this package imports no integration), the simulator and its
workload, ShareGPT's conversations (``sharegpt``) and the workloads made of them
(``conversations``), a model's real K/V over those conversations (``real_kv``,
for the codecs' tests and benchmark), and a reference transformer; the command line
(``tiercache.cli``) runs them. No core module imports this package.

Imports from: ``common``, ``policies``, ``blocks``, ``codecs``, ``telemetry``, ``bookkeeping``, ``tiers``, ``movement``,
``config``, ``remote``, ``manager``.
"""
