"""Storage tiers, one module each, registered by the ``type`` a YAML topology uses."""

from __future__ import annotations

import importlib

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
    """The class registered under ``type_name`` (KeyError if unknown)."""
    module_name, class_name = TIER_TYPES[type_name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["LOCAL_TIER_TYPES", "TIER_TYPES", "tier_class"]
