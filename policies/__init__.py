"""Eviction policies, one module each, registered by the name YAML uses (``policy: arc``)."""

from __future__ import annotations

import importlib
from typing import Any

from tiercache.policies.base import EvictionPolicy

POLICIES: dict[str, str] = {
    "lru": "tiercache.policies.lru:LRUPolicy",
    "arc": "tiercache.policies.arc:ARCPolicy",
    "s3fifo": "tiercache.policies.s3fifo:S3FIFOPolicy",
    "twoq": "tiercache.policies.twoq:TwoQPolicy",
}


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class registered under ``name`` (KeyError if unknown)."""
    module_name, class_name = POLICIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_policy(name: str, capacity: int, **options: Any) -> EvictionPolicy:
    """Instantiate the policy ``name`` for ``capacity`` resident keys."""
    return policy_class(name)(capacity, **options)


__all__ = ["POLICIES", "EvictionPolicy", "make_policy", "policy_class"]
