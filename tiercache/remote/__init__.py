"""The remote half: a topology's remote tiers built for a namespace, and the API for engines that keep their own
GPU and CPU tiers.

``build`` (each remote tier with its codec and lane, keyed by ``secret`` when the
namespace has one; closed and described the same way by every owner),
``store`` (``RemoteStore``: presence, reads and writes by the engine's own keys
into and from its own buffers), ``answers`` (the tiers' presence per key, what a
tier stored), ``secret`` (a keyed namespace's keys and MAC key) and ``inspect``
(``tiercache inspect``: a topology's report, each remote tier and each of its
servers checked).

Imports from: ``common``, ``blocks``, ``codecs``, ``telemetry``, ``tiers``, ``movement``, ``config``.
"""
