"""How central keeps room for new versions: a TTL per value and version key, an evicting policy, or the tier.

Nothing in the protocol deletes central's values or version keys by itself, so a
central store at ``maxmemory`` with ``noeviction`` refuses every commit (OOM).
Central keeps room with one of:

- ``central_ttl_s`` > 0: each commit gives its value and version key that TTL
  (an expired version key makes force_latest reads of that key misses, never
  stale hits), so the expiry (and a ``volatile-*`` policy) frees room;
- an ``allkeys-*`` maxmemory-policy (an evicted version key, likewise, turns
  force_latest reads into misses);
- failing both, the tier itself: a commit refused for memory makes it remove
  the oldest committed values (``room``), counted and logged while it lasts.

``check_retention`` reads central's policy at start and logs a warning naming
the better fix when neither of the first two holds.
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
    """Central refuses commits (OOM) once full: the tier frees room itself (``room``)."""
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
        "regional tier %s: central %s has maxmemory-policy %s and %s: once full, it refuses commits (OOM) and "
        "the tier removes the oldest values itself to make room; an allkeys-* policy or central_ttl_s lets "
        "central evict by itself",
        tier,
        where,
        policy,
        reason,
    )
    return Retention.STOPS
