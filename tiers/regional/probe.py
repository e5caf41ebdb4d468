"""Reachability of central and the region, each on its own (``tiercache inspect``).

A regional tier acknowledges a put once the region has it, so a probe through
the tier's own API says nothing about central: a central that rejects the
password would look reachable while replication fails. ``probe_stores`` probes
each server separately with the operations the tier needs (central: a versioned
commit, a version lookup, a read; region: a write, a read), deletes what it
wrote, and reports a failure with its cause (``diagnosis``: NOAUTH, WRONGPASS,
NOPERM, OOM, unreachable).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.tiers.regional.stores import CentralStore, RegionStore
from tiercache.tiers.regional.versions import value_version


@dataclass(frozen=True)
class StoreProbe:
    """One server's probe outcome."""

    role: str
    """``central`` or ``region``."""
    where: str
    """The server's URL without credentials."""
    ok: bool
    detail: str
    """What worked, or why it failed."""


async def probe_central(central: CentralStore, key: bytes, value: bytes) -> StoreProbe:
    """Commit ``value`` under ``key``, look its version up, read it back, delete it."""
    diagnosis = central.server.diagnosis
    (version,) = await central.commit([(key, value)])
    versions = await central.versions([key]) if version is not None else None
    read = await central.read([key]) if versions == [version] else None
    await central.delete([key])
    await central.server.call(lambda client: client.delete(central.keys.version(key)), None, "probe cleanup")
    ok = read is not None and read[0] is not None and value_version(read[0]) == version
    detail = "commit/version/read/delete of a probe block ok" if ok else diagnosis.explain()
    return StoreProbe("central", diagnosis.where, ok, detail)


async def probe_region(region: RegionStore, key: bytes, value: bytes) -> StoreProbe:
    """Write ``value`` under ``key``, read it back, delete it."""
    diagnosis = region.server.diagnosis
    written = await region.write([(key, value)])
    read = await region.read([key]) if written == [True] else None
    await region.delete([key])
    ok = read == [value]
    detail = "write/read/delete of a probe block ok" if ok else diagnosis.explain()
    return StoreProbe("region", diagnosis.where, ok, detail)
