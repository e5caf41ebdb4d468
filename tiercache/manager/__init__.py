"""The engine-facing facades: ``TierManager`` over one topology's parts, and ``LowerTiers`` for an engine that
keeps its own GPU pool.

``tier_manager`` (the API calls of docs/architecture.md, "The contract with the
engine"), ``lower_tiers`` (the CPU tier and remotes under an engine's own pool: its
scheduler looks up, fetches into CPU slots and writes into them; the copies are the
engine's), ``stack`` (every part of
a topology wired from its config, started, closed and described), ``books``
(the bookkeeping behind its one lock: every change to it, from the engine's calls
and the queues' reports), ``lookup`` (which tier serves each block of a prompt,
and the ``Lookup`` handle) and ``cost`` (the cost model: fetch or recompute).

Imports from: ``common``, ``policies``, ``blocks``, ``codecs``, ``telemetry``, ``bookkeeping``, ``tiers``, ``movement``,
``config``, ``remote``.
"""

from tiercache.bookkeeping.slots import CapacityError
from tiercache.manager.lookup import Lookup
from tiercache.manager.tier_manager import TierManager
from tiercache.movement.transfers import Transfer

__all__ = ["CapacityError", "Lookup", "TierManager", "Transfer"]
