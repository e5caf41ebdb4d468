"""Topologies: YAML -> typed, validated configuration (see ``tiercache.config.topology``).

``topology`` is the schema and the loader, ``typed`` builds dataclasses with
errors that name the file and field, ``validate`` holds the small checks every
``Options`` dataclass uses, ``checks`` the cross-field and machine checks, and
``env`` the ``TIERCACHE_*`` overrides.
"""

from tiercache.config.topology import (
    ENV_PREFIX,
    ConfigError,
    ModelConfig,
    PrefetchPolicy,
    QueueConfig,
    TierCacheConfig,
    TierConfig,
    WritePolicy,
    apply_env_overrides,
    build_dataclass,
    config_from_dict,
    default_config_path,
    load_config,
    parse_size,
)

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "ModelConfig",
    "PrefetchPolicy",
    "QueueConfig",
    "TierCacheConfig",
    "TierConfig",
    "WritePolicy",
    "apply_env_overrides",
    "build_dataclass",
    "config_from_dict",
    "default_config_path",
    "load_config",
    "parse_size",
]
