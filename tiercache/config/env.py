"""``TIERCACHE_*`` environment variables override topology fields before validation."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from tiercache.config.typed import ConfigError

ENV_PREFIX = "TIERCACHE_"
"""Variables with this prefix are overrides (``TIERCACHE_CONFIG`` names the file instead)."""


def _set_path(data: dict, parts: list[str], value: Any, variable: str) -> None:
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            target = None
            if part.isdigit() and int(part) < len(node):
                target = int(part)
            else:
                target = next(
                    (
                        i
                        for i, item in enumerate(node)
                        if isinstance(item, Mapping) and str(item.get("name", item.get("type"))).lower() == part
                    ),
                    None,
                )
            if target is None:
                raise ConfigError(variable, ".".join(parts[: depth + 1]), "an existing list index or tier name", part)
            if last:
                node[target] = value
            else:
                node = node[target]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(variable, ".".join(parts[:depth]), "a mapping or list to override into", node)


def apply_env_overrides(data: dict, environ: Mapping[str, str] | None = None) -> dict:
    """Apply ``TIERCACHE_A__B__C=value`` overrides onto the raw mapping."""
    environ = os.environ if environ is None else environ
    for variable, text in sorted(environ.items()):
        if not variable.startswith(ENV_PREFIX) or variable == "TIERCACHE_CONFIG":
            continue
        parts = [p.lower() for p in variable[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        _set_path(data, parts, value, f"environment variable {variable}")
    return data


def apply_overrides(data: dict, overrides: Mapping[str, Any], source: str) -> dict:
    """Apply ``{"tiers.redis.options.url": value}`` overrides (dotted paths, addressed as the variables') onto
    the raw mapping; ``source`` names where they came from in errors (an engine's config, say)."""
    for path, value in overrides.items():
        parts = [p.lower() for p in str(path).split(".") if p]
        if not parts:
            raise ConfigError(source, str(path), "a dotted field path such as tiers.redis.options.url", path)
        _set_path(data, parts, value, source)
    return data
