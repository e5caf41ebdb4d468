"""The ``regional`` tier: regional Redis stores synced with a central one.

The design is docs/architecture.md, "Central and regional sync". One concept per module:

- ``options``: ``RegionalOptions`` (the YAML ``options``) and ``SyncMode``.
- ``tier``: ``RegionalTier``, the ``RemoteTier`` (reads, read-through,
  ``force_latest``, writes, stats).
- ``versions``: central versions in the codec header, the central clock and the
  Lua scripts that commit, refresh, stamp and drop versioned copies.
- ``plane``: the data path (GET/SET/EXISTS/UNLINK, bulk reads) on the Redis tier's ``Node``.
- ``client``: fail-fast redis-py clients for the control plane (Lua, pub/sub, CONFIG).
- ``stores``: ``CentralStore`` and ``RegionStore``, block operations on each.
- ``replicator``: bounded background replication of a region's writes to central.
- ``invalidation``: drops stale regional copies on central's published updates.
- ``diagnosis``: names, counts and logs why calls fail (auth, ACL, OOM, unreachable).
- ``retention``: checks at start that a full central will not stop replication.
- ``reachability``: checks central and region apart (``tiercache inspect``).
"""

from tiercache.tiers.regional.options import RegionalOptions, SyncMode
from tiercache.tiers.regional.tier import RegionalTier
from tiercache.tiers.regional.versions import value_checksum, value_version

__all__ = ["RegionalOptions", "RegionalTier", "SyncMode", "value_checksum", "value_version"]
