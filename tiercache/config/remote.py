"""A remote-only topology: the remote tiers an engine puts under its own GPU and CPU tiers.

An engine that keeps its own GPU pool and CPU swap space (vLLM's offloading
tiers, SGLang's HiCache) hands tiercache only the levels below them. Its
topology is a YAML document with the ``tiers`` of a full topology minus the
local ones, and optionally ``model`` (tenant, LoRA id and the secret's variable:
the model id, dtype, block bytes and ranks come from the engine) and ``queues``.
Every remote tier is written on every write (``write_through``): the engine's
own tiers decide what is written, and nothing above a remote-only topology
evicts into it, so ``write_back`` and ``write_through_selective`` are refused.

Errors name the file (or the engine's config), the field and what was expected,
exactly as for a full topology; ``TIERCACHE_*`` variables and the engine
config's ``overrides`` (``{"tiers.redis.options.url": ...}``) apply first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiercache.bookkeeping.admission import WritePolicy
from tiercache.config.checks import validate_tier, validate_unique_names
from tiercache.config.env import apply_env_overrides, apply_overrides
from tiercache.config.topology import QueueConfig, TierConfig, read_yaml
from tiercache.config.typed import ConfigError, build_dataclass
from tiercache.tiers import LOCAL_TIER_TYPES, tier_class


@dataclass(frozen=True)
class RemoteModelConfig:
    """What of the namespace a remote-only topology may set; the engine supplies model, dtype and ranks."""

    tenant: str | None = None
    """Salt that keeps tenants sharing one store apart."""
    lora: str | None = None
    secret_env: str | None = None
    """Name of an environment variable holding the namespace's secret (16-64 bytes): values carry a keyed MAC."""


@dataclass
class RemoteTopology:
    """A validated remote-only topology (see the module docstring)."""

    tiers: list[TierConfig]
    model: RemoteModelConfig = field(default_factory=RemoteModelConfig)
    queues: QueueConfig = field(default_factory=QueueConfig)
    source: str = "<dict>"

    @property
    def versioned(self) -> bool:
        """Whether a tier keeps versions (a regional tier): what a ``force_latest`` read needs."""
        return any(tier_class(tier.type).capabilities.versioned for tier in self.tiers)


def remote_topology_from_dict(
    data: Any,
    source: str = "<dict>",
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RemoteTopology:
    """Validate a raw mapping (as loaded from YAML) into a ``RemoteTopology``."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, "", "a mapping with the remote tiers under 'tiers'", data)
    data = apply_env_overrides(dict(data), environ)
    if overrides:
        data = apply_overrides(data, overrides, f"{source} (overrides)")
    topology = build_dataclass(RemoteTopology, {**data, "source": source}, source, "")
    if not topology.tiers:
        raise ConfigError(source, "tiers", "a non-empty list of remote tiers", topology.tiers)
    for index, tier in enumerate(topology.tiers):
        path = f"tiers[{index}]"
        if tier.type in LOCAL_TIER_TYPES:
            raise ConfigError(
                source, f"{path}.type", "a remote tier type (the engine keeps its own GPU and CPU tiers)", tier.type
            )
        validate_tier(tier, index, source, None)
        if tier.write_policy is not WritePolicy.WRITE_THROUGH:
            raise ConfigError(
                source,
                f"{path}.write_policy",
                "write_through (the engine's own tiers decide what reaches a remote-only topology)",
                tier.write_policy.value,
            )
    validate_unique_names(topology.tiers, source)
    return topology


def load_remote_topology(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RemoteTopology:
    """Read and validate a remote-only YAML topology file."""
    return remote_topology_from_dict(read_yaml(path), str(path), overrides, environ)


def remote_topology(
    value: Any, source: str, overrides: Mapping[str, Any] | None = None, field_name: str = "topology"
) -> RemoteTopology:
    """The remote-only topology an engine's config names: the path of its YAML file, or the mapping itself."""
    if isinstance(value, str | os.PathLike) and str(value):
        return load_remote_topology(value, overrides)
    if isinstance(value, Mapping):
        return remote_topology_from_dict(value, f"{source} {field_name}", overrides)
    expected = "the path of a remote-only tiercache topology (YAML), or that topology as a JSON object"
    raise ConfigError(source, field_name, expected, value)
