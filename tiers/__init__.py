"""Storage tiers, one module each, registered by the ``type`` a YAML topology uses.

A topology may also name a remote tier outside tiercache by module path
(``type: mypkg.tiers:S3Tier``): any subclass of ``tiercache.tiers.base.RemoteTier``
(see ``tiers/base.py`` for the contract, and ``tiercache.testing.conformance``
for the suite that checks it). Importing this package imports no tier.
``coded`` is no tier type of its own: it wraps any remote tier whose ``codec``
lists lossy levels (``tiercache.remote.build`` does).

Imports from: ``common``, ``policies``, ``blocks``, ``codecs``, ``bookkeeping`` (the local tiers' slot tables).
"""

from __future__ import annotations

from tiercache.common.plugins import PluginError, class_name, find_class, is_module_path

TIER_TYPES: dict[str, str] = {
    "gpu": "tiercache.tiers.gpu:GpuTier",
    "cpu": "tiercache.tiers.cpu:CpuTier",
    "simulated": "tiercache.tiers.simulated:SimulatedTier",
    "regional": "tiercache.tiers.regional:RegionalTier",
    "redis": "tiercache.tiers.redis:RedisTier",
    "file": "tiercache.tiers.file:FileTier",
}
"""Local tiers (``gpu``, ``cpu``) first; every other type is a ``RemoteTier``."""

LOCAL_TIER_TYPES = ("gpu", "cpu")


def tier_class(type_name: str) -> type:
    """The class registered under ``type_name``, or the ``RemoteTier`` a module path names.

    ``KeyError`` for an unknown short name; ``PluginError`` (why) for a module
    path that does not name a concrete ``RemoteTier`` subclass.
    """
    from tiercache.tiers.base import RemoteTier  # only when asked: importing the registry imports no tier

    return find_class(type_name, TIER_TYPES, RemoteTier)


def default_tier_name(type_name: str) -> str:
    """A tier's name when the topology gives none: its type, or a plug-in's class name."""
    return class_name(type_name) if is_module_path(type_name) else type_name


__all__ = ["LOCAL_TIER_TYPES", "TIER_TYPES", "PluginError", "default_tier_name", "tier_class"]
