"""How central keeps room for new versions: a TTL per value and version key, or an evicting policy.

Nothing in the protocol deletes central's values or version keys, so a central
store at ``maxmemory`` with ``noeviction`` refuses every commit (OOM) and
replication stops for good. Central needs one of:

- ``central_ttl_s`` > 0: each commit gives its value and version key that TTL
  (an expired version key makes force_latest reads of that key misses, never
  stale hits), so the expiry (and a ``volatile-*`` policy) frees room;
- an ``allkeys-*`` maxmemory-policy (an evicted version key, likewise, turns
  force_latest reads into misses).

``check_retention`` reads central's policy at start and logs a warning naming
the fix when neither holds; commits that fail anyway are counted and logged by
cause (``diagnosis``).
"""

from __future__ import annotations

import enum
import logging

from tiercache.tiers.regional.stores import CentralStore

log = logging.getLogger(__name__)
ALLKEYS_PREFIX = "allkeys-"
"""Policies that evict any key, version keys included."""
VOLATILE_PREFIX = "volatile-"
"""Policies that evict only keys with a TTL."""


class Retention(enum.Enum):
    """What central will do when it is full, as far as the tier can tell at start."""

    EVICTS = "evicts"
    """An allkeys-* policy, or a TTL on what the tier writes: commits keep finding room."""
    UNBOUNDED = "unbounded"
    """No maxmemory: central grows until the host runs out of memory."""
    STOPS = "stops"
    """Commits fail (OOM) once central is full: replication stops."""
    UNKNOWN = "unknown"
    """Central did not say (down, ``CONFIG`` denied by an ACL, or hidden)."""


async def check_retention(central: CentralStore, ttl_s: float, tier: str) -> Retention:
    """Ask central for its maxmemory policy and log what will happen when it is full."""
    memory = await central.memory_policy()
    where = central.server.diagnosis.where
    if memory is None:
        log.info("regional tier %s: could not read central %s's maxmemory policy; not checked", tier, where)
        return Retention.UNKNOWN
    maxmemory, policy = memory
    if maxmemory == 0:
        log.warning(
            "regional tier %s: central %s has no maxmemory: it grows without bound%s",
            tier,
            where,
            "" if ttl_s > 0 else " (set maxmemory with an allkeys-* policy, or central_ttl_s)",
        )
        return Retention.UNBOUNDED
    if ttl_s > 0 or policy.startswith(ALLKEYS_PREFIX):
        return Retention.EVICTS
    reason = "nothing the tier writes has a TTL" if policy.startswith(VOLATILE_PREFIX) else "it never evicts"
    log.warning(
        "regional tier %s: central %s has maxmemory-policy %s and %s: once full, every commit fails (OOM) and "
        "replication stops; use an allkeys-* policy or set central_ttl_s",
        tier,
        where,
        policy,
        reason,
    )
    return Retention.STOPS
