"""The ``simulated`` remote tier: latency, bandwidth, jitter and injected faults, in process."""

from tiercache.tiers.simulated.options import SimulatedOptions
from tiercache.tiers.simulated.store import SimulatedStore
from tiercache.tiers.simulated.tier import OP_KINDS, SimulatedTier

__all__ = ["OP_KINDS", "SimulatedOptions", "SimulatedStore", "SimulatedTier"]
