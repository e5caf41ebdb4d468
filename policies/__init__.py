"""Eviction policies, one module each, registered by the name YAML uses (``policy: arc``)."""

from __future__ import annotations

import importlib
from typing import Any

from tiercache.policies.base import EvictionPolicy

POLICIES: dict[str, str] = {
    "lru": "tiercache.policies.lru:LRUPolicy",
}


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class registered under ``name`` (KeyError if unknown)."""
    module_name, class_name = POLICIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_policy(name: str, capacity: int, **options: Any) -> EvictionPolicy:
    """Instantiate the policy ``name`` for ``capacity`` resident keys."""
    return policy_class(name)(capacity, **options)


__all__ = ["POLICIES", "EvictionPolicy", "make_policy", "policy_class"]
