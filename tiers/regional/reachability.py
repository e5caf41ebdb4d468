"""Reachability of central and the region, each on its own (``RegionalTier.check_reachability``).

A regional tier acknowledges a put once the region has it, so a check through
the tier's own calls says nothing about central: a central that rejects the
password would look reachable while replication fails. Each server is checked
separately with the operations the tier needs (central: a versioned commit, a
version lookup, a read; region: a write, a read), what was written is deleted,
and a failure is reported with its cause (``diagnosis``: NOAUTH, WRONGPASS,
NOPERM, OOM, unreachable).
"""

from __future__ import annotations

from tiercache.tiers.base import ServerReachability
from tiercache.tiers.regional.stores import CentralStore, RegionStore
from tiercache.tiers.regional.versions import value_version


async def check_central(central: CentralStore, key: bytes, value: bytes) -> ServerReachability:
    """Commit ``value`` under ``key``, look its version up, read it back, delete it."""
    diagnosis = central.server.diagnosis
    (version,) = await central.commit([(key, value)])
    versions = await central.versions([key]) if version is not None else None
    read = await central.read([key]) if versions == [version] else None
    await central.delete([key])
    await central.server.call(lambda client: client.delete(central.keys.version(key)), None, "check cleanup")
    ok = read is not None and read[0] is not None and value_version(read[0]) == version
    detail = "commit/version/read/delete of a check block ok" if ok else diagnosis.explain()
    return ServerReachability("central", diagnosis.where, ok, detail)


async def check_region(region: RegionStore, key: bytes, value: bytes) -> ServerReachability:
    """Write ``value`` under ``key``, read it back, delete it."""
    diagnosis = region.server.diagnosis
    written = await region.write([(key, value)])
    read = await region.read([key]) if written == [True] else None
    await region.delete([key])
    ok = read == [value]
    detail = "write/read/delete of a check block ok" if ok else diagnosis.explain()
    return ServerReachability("region", diagnosis.where, ok, detail)
