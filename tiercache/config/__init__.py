"""Topologies: YAML -> typed, validated configuration.

``topology`` is the schema and the loader, ``remote`` the remote-only topology an
engine's adapter loads, ``typed`` builds dataclasses with errors that name the
file and field, ``checks`` the cross-field and machine checks, ``env`` the
``TIERCACHE_*`` overrides, ``cost_options`` the cost model's settings and ``machine``
what this host can allocate.

Imports from: ``common``, ``policies``, ``blocks``, ``codecs``, ``telemetry``, ``bookkeeping``, ``tiers``.
"""

from tiercache.common.fields import parse_size
from tiercache.config.env import ENV_PREFIX, apply_env_overrides
from tiercache.config.topology import (
    ModelConfig,
    PrefetchPolicy,
    QueueConfig,
    TierCacheConfig,
    TierConfig,
    config_from_dict,
    default_config_path,
    load_config,
)
from tiercache.config.typed import ConfigError, build_dataclass

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "ModelConfig",
    "PrefetchPolicy",
    "QueueConfig",
    "TierCacheConfig",
    "TierConfig",
    "apply_env_overrides",
    "build_dataclass",
    "config_from_dict",
    "default_config_path",
    "load_config",
    "parse_size",
]
