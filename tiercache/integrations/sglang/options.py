"""The backend's options, read from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

SGLang hands a ``dynamic`` backend that JSON as ``HiCacheStorageConfig.extra_config``, together with its own
keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``), which are left alone, as is any
other key but a near miss of one of tiercache's (a misspelling, refused with the key it resembles). tiercache's:

- ``topology`` (required): the remote-only topology (``tiercache.config.remote``), as the path of a YAML file
  or inline as a mapping;
- ``overrides``: dotted field paths set on the topology, e.g. ``{"tiers.redis.options.url": "redis://h:6379"}``;
- ``force_latest``: reads ask a regional topology's central store for the newest version of every page
  (refused for a topology without a versioned tier).

Every error names the flag, the field and what was expected, before SGLang starts serving.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiercache.config.remote import RemoteTopology, remote_topology
from tiercache.config.typed import ConfigError

SOURCE = "--hicache-storage-backend-extra-config"
"""Where the options come from, as errors name it."""
OWN_KEYS = ("topology", "overrides", "force_latest")
NEAR_MISS = 0.8
"""How alike (``difflib`` ratio) an unknown key and one of ``OWN_KEYS`` are for the key to be a misspelling."""


@dataclass(frozen=True)
class BackendOptions:
    """What a ``TierCacheStorage`` is configured with."""

    topology: RemoteTopology
    force_latest: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendOptions:
        """Validate tiercache's keys of SGLang's extra config (see the module docstring)."""
        if not isinstance(extra, Mapping):
            raise ConfigError(SOURCE, "", "a JSON object with tiercache's 'topology'", extra)
        for key in extra:
            meant = difflib.get_close_matches(str(key), OWN_KEYS, n=1, cutoff=NEAR_MISS)
            if key not in OWN_KEYS and meant:
                expected = f"one of tiercache's keys ({', '.join(OWN_KEYS)}); did you mean {meant[0]!r}?"
                raise ConfigError(SOURCE, str(key), expected, "an unknown key")
        overrides = extra.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            raise ConfigError(SOURCE, "overrides", "a JSON object of dotted field paths to values", overrides)
        force_latest = extra.get("force_latest", False)
        if not isinstance(force_latest, bool):
            raise ConfigError(SOURCE, "force_latest", "true or false", force_latest)
        topology = remote_topology(extra.get("topology"), SOURCE, overrides)
        if force_latest and not topology.versioned:
            expected = "false, or a topology with a versioned tier (type: regional)"
            raise ConfigError(SOURCE, "force_latest", expected, True)
        return cls(topology, force_latest)
