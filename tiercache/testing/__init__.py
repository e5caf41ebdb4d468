"""Test support that ships with tiercache, for its own tests and for third-party tiers.

``conformance``: the remote-tier contract (``tiercache.tiers.base``) as a suite
of checks any ``RemoteTier`` runs, with pytest (subclass ``RemoteTierContract``)
or without (``asyncio.run(check(harness))`` for each of ``CHECKS``).

Imports from: the core (every folder but ``integrations`` and ``tools``).
"""
