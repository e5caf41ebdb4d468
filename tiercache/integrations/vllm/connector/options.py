"""The connector's options, read from ``--kv-transfer-config``'s ``kv_connector_extra_config``.

- ``topology`` (required): the tiers under vLLM's own GPU pool: a tiercache topology whose first
  tier is the CPU tier (``type: cpu``, with ``capacity_bytes`` or ``capacity_blocks``), then any
  remotes (Redis, Redis Cluster, regional + central, file), with its ``queues``, ``cost``,
  ``events``, ``mrc`` and ``model`` (``tenant``, ``secret_env``) sections; as the path of a YAML
  file or inline as a mapping. The model id and the layout come from vLLM and may not be given;
- ``overrides``: dotted field paths set on the topology, e.g. ``{"tiers.redis.options.url": ...}``;
- ``force_latest``: loads ask a regional topology's central store for the newest version
  (refused for a topology without a versioned tier);
- ``shared_dir``: where the CPU tier's shared memory lives (default ``/dev/shm``);
- ``loads``: ``auto`` (default: synchronous while vLLM ran nothing in its last step, else asynchronous),
  ``sync`` or ``async`` (``LoadMode``; a model of several KV-cache groups always loads asynchronously);
- ``idle_wait_ms``: while vLLM's last step ran nothing, how long per step the scheduler side waits for a
  remote's answer or fetch instead of asking vLLM to ask again (default 100; 0: never waits);
- ``staging_mib``: on CUDA, the most device memory one step's stores stage before their copy to the
  CPU tier (a store past it is skipped: a later miss, never an error); loads stage in chunks of half
  of it. By default it is what the step's largest prefill fills: ``max_num_batched_tokens`` over the
  block size, plus one block, of this rank's KV (logged at start).
- ``host``: the Unix socket of a host cache server (``tiercache serve``): its CPU tier and remotes, shared by
  every engine on the host, instead of this engine's own; ``topology`` is then optional and may not name tiers
  (its ``model`` section still applies). The scheduler side attaches over the socket, the workers map the
  server's region; a server down or restarted is a miss (docs/engines.md, "On a host cache server").
- ``codec``: a remote tier's ``codec`` (``tiercache.codecs.levels.CodecConfig``) for every remote tier of
  the topology that names none. The connector's pages stay vLLM's bytes (its layout, packed per the CPU
  attention kernel's instruction set on the CPU build), but the connector tells the layout their element
  dtype and group size (the head size, from vLLM's KV cache spec: ``SlotGeometry``), so ``int8`` stores
  each group of ``head_size`` contiguous elements as 8-bit integers under one float16 scale; ``compact``
  (tokens x channels per layer) is declined with a log line, and a KV cache whose elements are not floats
  (an fp8 cache vLLM keeps as uint8) or whose groups differ in dtype stores exact KV, logged.

A key that is none of these is refused with the one it resembles. Every error names the flag,
the field and what was expected, before vLLM serves a request.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.blocks.model_identity import ModelIdentity
from tiercache.blocks.namespaces import PageFormat
from tiercache.common.units import MS_PER_SECOND
from tiercache.config import ConfigError, TierCacheConfig, config_from_dict
from tiercache.config.env import apply_overrides
from tiercache.config.topology import read_yaml
from tiercache.integrations.vllm.connector.geometry import SlotGeometry
from tiercache.tiers import tier_class

SOURCE = "--kv-transfer-config kv_connector_extra_config"
"""Where the options come from, as errors name it."""
OWN_KEYS = ("topology", "overrides", "force_latest", "shared_dir", "staging_mib", "idle_wait_ms", "loads", "codec",
            "host")
HOST_TIERS = [{"type": "cpu", "capacity_blocks": 1}]
"""An engine's tiers on a host server: the server's own, so the engine's topology names none (this stands in)."""


class LoadMode(enum.Enum):
    """How a hit is loaded into vLLM's blocks (docs/engines.md, "Synchronous and asynchronous loads")."""

    AUTO = "auto"
    """Synchronous while vLLM ran nothing in its last step (the request's first token comes soonest), else
    asynchronous (the running batch never waits for the copy); asynchronous for a model of several KV-cache groups."""
    SYNC = "sync"
    """In the step that schedules the request, before its forward (every running request's step waits for it)."""
    ASYNC = "async"
    """While the request waits in vLLM's WAITING_FOR_REMOTE_KVS and the batch runs on; scheduled once copied."""

ENGINE_FIELDS = ("id", "tp_rank")
"""``model`` fields vLLM supplies: a topology may not set them."""
MIB = 1 << 20
MAX_IDLE_MS = 1000
"""Longest idle wait accepted (longer would hold a request that arrives meanwhile for too long)."""
DEFAULT_IDLE_WAIT_MS = 100
"""How long the scheduler side may wait for a remote per step while vLLM has nothing else to run (a request
arriving meanwhile waits at most this); vLLM would otherwise spin through empty steps, taking the CPU the fetch
needs."""
DEFAULT_SHARED_DIR = "/dev/shm"
"""Shared memory on Linux: the CPU tier's region lives in RAM, not on a disk."""


@dataclass(frozen=True)
class ConnectorOptions:
    """What a ``TierCacheConnector`` is configured with (the topology still without vLLM's part)."""

    topology: Mapping[str, Any]
    source: str
    force_latest: bool
    shared_dir: Path
    staging_bytes: int | None = None
    """``staging_mib`` in bytes; None: derived from the step's size (``step_budget.store_budget_bytes``)."""
    idle_wait_s: float = DEFAULT_IDLE_WAIT_MS / MS_PER_SECOND
    loads: LoadMode = LoadMode.AUTO
    codec: Mapping[str, Any] | None = None
    """The ``codec`` of every remote tier that names none (None: each tier's own, exact by default)."""
    host: Path | None = None
    """The host cache server's socket (``tiercache serve``): its CPU tier and remotes instead of this engine's own."""

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        for key in extra:
            if key not in OWN_KEYS:
                meant = difflib.get_close_matches(str(key), OWN_KEYS, n=1)
                hint = f" (did you mean {meant[0]!r}?)" if meant else ""
                raise ConfigError(SOURCE, str(key), f"one of {list(OWN_KEYS)}{hint}", "an unknown key")
        host = extra.get("host")
        if host is not None and (not isinstance(host, str) or not host):
            raise ConfigError(SOURCE, "host", "the path of a tiercache host server's Unix socket", host)
        if host is None and "topology" not in extra:
            raise ConfigError(SOURCE, "topology", "the tiers under vLLM's pool: a YAML path or a mapping whose "
                              "first tier is {'type': 'cpu', 'capacity_bytes': ...}", "nothing")
        topology, source = _raw_topology(extra.get("topology", {}))
        if host is not None:
            if "tiers" in topology:
                raise ConfigError(source, "tiers", "nothing with host: the host server's topology has them",
                                  topology["tiers"])
            topology = {**topology, "tiers": HOST_TIERS}
        overrides = extra.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            raise ConfigError(SOURCE, "overrides", "a mapping of dotted field paths to values", overrides)
        topology = apply_overrides(topology, overrides, f"{SOURCE} overrides")
        force_latest = extra.get("force_latest", False)
        if not isinstance(force_latest, bool):
            raise ConfigError(SOURCE, "force_latest", "true or false", force_latest)
        shared = extra.get("shared_dir", DEFAULT_SHARED_DIR if os.path.isdir(DEFAULT_SHARED_DIR) else None)
        shared_dir = Path(shared or tempfile.gettempdir())
        if not shared_dir.is_dir():
            raise ConfigError(SOURCE, "shared_dir", "an existing directory (shared memory: /dev/shm)", str(shared))
        staging = extra.get("staging_mib")
        if staging is not None and (isinstance(staging, bool) or not isinstance(staging, int) or staging <= 0):
            raise ConfigError(SOURCE, "staging_mib", "a positive whole number of MiB", staging)
        idle_wait = extra.get("idle_wait_ms", DEFAULT_IDLE_WAIT_MS)
        if isinstance(idle_wait, bool) or not isinstance(idle_wait, int | float) or not 0 <= idle_wait <= MAX_IDLE_MS:
            raise ConfigError(SOURCE, "idle_wait_ms", f"a number of milliseconds from 0 to {MAX_IDLE_MS}", idle_wait)
        codec = extra.get("codec")
        if codec is not None and not isinstance(codec, Mapping):
            raise ConfigError(SOURCE, "codec", "a remote tier's codec: {levels: [...], adaptive, tables}", codec)
        loads = extra.get("loads", LoadMode.AUTO.value)
        if loads not in {mode.value for mode in LoadMode}:
            raise ConfigError(SOURCE, "loads", f"one of {[mode.value for mode in LoadMode]}", loads)
        return cls(topology, source, force_latest, shared_dir, staging * MIB if staging is not None else None,
                   idle_wait / MS_PER_SECOND, LoadMode(loads), codec, Path(host) if host is not None else None)

    def config(self, model: ModelIdentity, geometry: SlotGeometry, page_format: PageFormat) -> TierCacheConfig:
        """The whole topology: the user's tiers with vLLM's model and its slots as pages of ``page_format`` with
        their element dtype and group size (the namespace is then ``engine_namespace(model, page_format)`` with
        those two, built by the stack)."""
        data = dict(self.topology)
        model_section = data.get("model") or {}
        if not isinstance(model_section, Mapping):
            raise ConfigError(self.source, "model", "a mapping (tenant, secret_env)", model_section)
        for name in ENGINE_FIELDS:
            if name in model_section:
                raise ConfigError(self.source, f"model.{name}", "nothing: vLLM supplies it", model_section[name])
        if "layout" in data:
            raise ConfigError(self.source, "layout", "nothing: vLLM's KV cache fixes it", data["layout"])
        data["model"] = {**model_section, "id": model.model_id}
        data["layout"] = {"block_bytes": geometry.slot_bytes, "block_size": geometry.block_size}
        tiers = data.get("tiers")
        if self.codec is not None and isinstance(tiers, list):
            data["tiers"] = [tier if index == 0 or not isinstance(tier, Mapping) or "codec" in tier
                             else {**tier, "codec": dict(self.codec)} for index, tier in enumerate(tiers)]
        config = config_from_dict(data, self.source, engine_pool=True)
        config.layout = dataclasses.replace(config.layout, engine_format=page_format,
                                            element_dtype=geometry.element_dtype,
                                            group_elements=geometry.group_elements)
        if self.force_latest and self.host is None and not any(tier_class(t.type).capabilities.versioned
                                                                for t in config.tiers[1:]):
            raise ConfigError(SOURCE, "force_latest", "false, or a topology with a versioned tier (type: regional)",
                              True)
        return config


def _raw_topology(value: Any) -> tuple[dict[str, Any], str]:
    """The topology as a raw mapping, and where it came from (for errors)."""
    if isinstance(value, str | os.PathLike) and str(value):
        data = read_yaml(value)
        if not isinstance(data, Mapping):
            raise ConfigError(str(value), "", "a mapping with the tiers under 'tiers'", data)
        return dict(data), str(value)
    if isinstance(value, Mapping):
        return dict(value), f"{SOURCE} topology"
    raise ConfigError(SOURCE, "topology", "the path of a tiercache topology (YAML), or that topology as a mapping",
                      value)
