"""Topologies: YAML -> typed, validated configuration (see ``tiercache.config.topology``).

``topology`` is the schema and the loader, ``typed`` builds dataclasses with
errors that name the file and field, ``validate`` holds the small checks every
``Options`` dataclass uses, ``checks`` the cross-field and machine checks, and
``env`` the ``TIERCACHE_*`` overrides. The names below are imported on first
use, so a tier's options module can use ``validate`` without loading the schema
(which needs the layout, which uses ``validate``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ENV_PREFIX": "tiercache.config.env",
    "apply_env_overrides": "tiercache.config.env",
    "ConfigError": "tiercache.config.typed",
    "build_dataclass": "tiercache.config.typed",
    "parse_size": "tiercache.config.validate",
    "ModelConfig": "tiercache.config.topology",
    "PrefetchPolicy": "tiercache.config.topology",
    "QueueConfig": "tiercache.config.topology",
    "TierCacheConfig": "tiercache.config.topology",
    "TierConfig": "tiercache.config.topology",
    "WritePolicy": "tiercache.config.topology",
    "config_from_dict": "tiercache.config.topology",
    "default_config_path": "tiercache.config.topology",
    "load_config": "tiercache.config.topology",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tiercache.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
