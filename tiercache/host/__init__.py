"""The host cache server: one CPU tier, with its policy and the remotes below it, for every engine on a host.

``server`` (``HostServer``, what ``tiercache serve`` runs: a ``LowerTiers`` over a
shared-memory region it creates, a Unix socket), ``connection`` (one attached
engine: its calls answered, its leases taken back when it goes),
``client`` (``HostTiers``: the surface of ``LowerTiers`` across the socket, a
miss whenever the server is down or slow), ``attachment`` (one attachment's
socket and the handles an engine holds), ``engines`` (an engine's model and
layout, which a tiers-only server adopts), ``wire`` (the frames between them),
``region`` (the region's file, checked by every engine that maps it) and
``leases`` (pure bookkeeping: what an attached engine holds, taken back when it
goes away). The design is docs/architecture.md, "The host cache server".

Imports from: ``common``, ``blocks``, ``config``, ``remote``, ``manager``.
"""
