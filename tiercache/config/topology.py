"""YAML topology -> typed, validated configuration.

Every error names the file, the field path (``tiers[2].options.url``) and what
was expected. ``TIERCACHE_*`` environment variables override fields before
validation: ``TIERCACHE_TIERS__REDIS__OPTIONS__URL=redis://h:6379`` sets the
``options.url`` of the tier named ``redis``; path parts are separated by ``__``,
list items are addressed by index or by their ``name``, and values are parsed as
YAML scalars.
"""

from __future__ import annotations

import enum
import importlib.resources
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiercache.blocks.layout import KVLayout, PageLayout
from tiercache.bookkeeping.admission import WritePolicy
from tiercache.codecs.levels import CodecConfig
from tiercache.common.fields import (
    int_in_range,
    non_empty_string,
    number_in_range,
    parse_size,
    positive_timeout_ms,
    queue_size,
    worker_count,
)
from tiercache.common.units import MS_PER_SECOND
from tiercache.config.checks import validate_hierarchy, validate_tier
from tiercache.config.cost_options import CostConfig
from tiercache.config.env import ENV_PREFIX, apply_env_overrides
from tiercache.config.typed import ConfigError, build_dataclass
from tiercache.telemetry.events.config import EventsConfig
from tiercache.telemetry.mrc import MrcConfig

MAX_TP_RANK = 1 << 16
"""Largest tensor-parallel rank accepted."""
MAX_PREFETCH_MS_PER_1K_TOKENS = 60_000.0
"""Largest per-1k-token growth of the prefetch deadline (a minute per 1k tokens)."""
TOKENS_PER_K = 1000.0
"""The tokens of the "1k" in ``prefetch_timeout_ms_per_1k_tokens``."""
MAX_YAML_DEPTH_HINT = "a YAML document nested less deeply (the parser ran out of recursion)"
"""What a topology too deeply nested for the parser is told it should be."""


class PrefetchPolicy(enum.Enum):
    """How long a load waits for slow tiers."""

    BEST_EFFORT = "best_effort"
    """Report what has arrived when polled; the engine recomputes the rest."""
    WAIT_COMPLETE = "wait_complete"
    """The load finishes when every block has arrived or failed."""
    TIMEOUT = "timeout"
    """Like wait_complete, but give up after a deadline that grows with the tokens."""


@dataclass(frozen=True)
class ModelConfig:
    """The namespace: what must match for engines to share entries."""

    id: str
    tp_rank: int = 0
    tenant: str | None = None
    lora: str | None = None
    secret_env: str | None = None
    """Name of an environment variable holding the namespace's secret (16-64 bytes): values then carry
    a keyed MAC, so a writer without it cannot forge KV a reader accepts. Never the secret itself."""

    def __post_init__(self) -> None:
        non_empty_string("id", self.id)
        int_in_range("tp_rank", self.tp_rank, 0, MAX_TP_RANK)


@dataclass
class TierConfig:
    """One tier of the hierarchy, fastest first."""

    type: str
    name: str | None = None
    capacity_blocks: int | None = None
    capacity_bytes: int | str | None = None
    policy: str = "lru"
    policy_options: dict[str, Any] = field(default_factory=dict)
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    admit_after_hits: int = 2
    options: Any = field(default_factory=dict)
    codec: CodecConfig = field(default_factory=CodecConfig)
    """The levels a remote tier stores KV at and reads it at (``tiercache.codecs``); local tiers keep exact KV."""


@dataclass(frozen=True)
class QueueConfig:
    """Concurrency and back-pressure of the transfer queue, and the prefetch policy."""

    transfer_concurrency: int = 8
    max_pending_stores: int = 1024
    batch_blocks: int = 64
    prefetch: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    prefetch_timeout_ms: float = 50.0
    prefetch_timeout_ms_per_1k_tokens: float = 20.0
    remote_lookup_timeout_ms: float = 200.0

    def __post_init__(self) -> None:
        worker_count("transfer_concurrency", self.transfer_concurrency)
        queue_size("max_pending_stores", self.max_pending_stores, low=0)
        queue_size("batch_blocks", self.batch_blocks)
        # 0 or less would turn every prefetch / remote lookup into an instant miss.
        positive_timeout_ms("prefetch_timeout_ms", self.prefetch_timeout_ms)
        positive_timeout_ms("remote_lookup_timeout_ms", self.remote_lookup_timeout_ms)
        per_1k = self.prefetch_timeout_ms_per_1k_tokens
        number_in_range("prefetch_timeout_ms_per_1k_tokens", per_1k, 0.0, MAX_PREFETCH_MS_PER_1K_TOKENS)

    def prefetch_wait_s(self, tokens: int) -> float:
        """How long a caller may wait for a load of ``tokens`` tokens (the prefetch policy's one meaning):
        ``best_effort`` 0 (what arrived by its next look), ``wait_complete`` ``math.inf`` (every block arrived
        or failed), ``timeout`` a base plus a share that grows with the tokens."""
        if self.prefetch is PrefetchPolicy.BEST_EFFORT:
            return 0.0
        if self.prefetch is PrefetchPolicy.WAIT_COMPLETE:
            return math.inf
        per_token_ms = self.prefetch_timeout_ms_per_1k_tokens / TOKENS_PER_K
        return (self.prefetch_timeout_ms + per_token_ms * tokens) / MS_PER_SECOND


@dataclass
class TierCacheConfig:
    """A validated topology."""

    model: ModelConfig
    layout: KVLayout | PageLayout
    """K/V per layer (every topology), or an engine's opaque pages (only below an engine's own pool)."""
    tiers: list[TierConfig]
    exclusive: bool = False
    queues: QueueConfig = field(default_factory=QueueConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    mrc: MrcConfig = field(default_factory=MrcConfig)
    source: str = "<dict>"

    def tier(self, name: str) -> TierConfig:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)


def config_from_dict(
    data: Any, source: str = "<dict>", environ: Mapping[str, str] | None = None, *, engine_pool: bool = False
) -> TierCacheConfig:
    """Validate a raw mapping (as loaded from YAML) into a ``TierCacheConfig``; ``engine_pool``: the engine keeps
    its own GPU pool, so the tiers start with the CPU tier (``LowerTiers``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, "", "a mapping with model, layout and tiers", data)
    data = apply_env_overrides(dict(data), environ)
    config = build_dataclass(TierCacheConfig, {**data, "source": source}, source, "")
    for index, tier in enumerate(config.tiers):
        validate_tier(tier, index, source, config.layout)
    validate_hierarchy(config, engine_pool=engine_pool)
    return config


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None, *,
                engine_pool: bool = False) -> TierCacheConfig:
    """Read and validate a YAML topology file (``engine_pool``: as ``config_from_dict``'s)."""
    return config_from_dict(read_yaml(path), str(path), environ, engine_pool=engine_pool)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The YAML document of a file; a ``ConfigError`` naming the file (and line) when it cannot be read."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(source, "", "a readable YAML file", error.strerror) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        bad = raw[error.start : error.end]
        raise ConfigError(source, f"line {line}, byte {error.start}", "UTF-8 text", bad) from None
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(source, "document", MAX_YAML_DEPTH_HINT) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "document"
        raise ConfigError(source, where, "valid YAML", str(getattr(error, "problem", error))) from None


def default_config_path() -> Path:
    """The embedded default topology (GPU pool + pinned CPU, no server needed)."""
    return Path(str(importlib.resources.files("tiercache.configs").joinpath("default.yaml")))


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
