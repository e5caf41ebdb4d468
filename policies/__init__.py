"""Eviction policies, one module each, registered by the name YAML uses (``policy: arc``).

A topology may also name a policy outside tiercache by module path (``policy:
mypkg.policies:Mine``): any subclass of ``tiercache.policies.base.EvictionPolicy``.

Imports from: ``common``.
"""

from __future__ import annotations

from typing import Any

from tiercache.common.plugins import PluginError, find_class
from tiercache.policies.base import EvictionPolicy
from tiercache.policies.keyed import KeyedPolicy

POLICIES: dict[str, str] = {
    "lru": "tiercache.policies.lru:LRUPolicy",
    "arc": "tiercache.policies.arc:ARCPolicy",
    "s3fifo": "tiercache.policies.s3fifo:S3FIFOPolicy",
    "twoq": "tiercache.policies.twoq:TwoQPolicy",
}


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy registered under ``name``, or the one a module path names.

    ``KeyError`` for an unknown short name; ``PluginError`` (why) for a module
    path that does not name a concrete ``EvictionPolicy`` subclass.
    """
    return find_class(name, POLICIES, EvictionPolicy)


def make_policy(name: str, capacity: int, **options: Any) -> EvictionPolicy:
    """Instantiate the policy ``name`` (registered or a module path) for ``capacity`` entries (a tier's slots)."""
    return policy_class(name)(capacity, **options)


def keyed_policy(name: str, capacity: int, **options: Any) -> KeyedPolicy:
    """The policy ``name`` for ``capacity`` resident keys, driven by keys alone (no slots)."""
    return KeyedPolicy(make_policy(name, capacity, **options))


__all__ = ["POLICIES", "EvictionPolicy", "KeyedPolicy", "PluginError", "keyed_policy", "make_policy", "policy_class"]
