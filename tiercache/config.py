"""YAML topology -> typed, validated configuration.

Every error names the file, the field path (``tiers[2].options.url``) and what
was expected. ``TIERCACHE_*`` environment variables override fields before
validation: ``TIERCACHE_TIERS__REDIS__OPTIONS__URL=redis://h:6379`` sets the
``options.url`` of the tier named ``redis``; path parts are separated by ``__``,
list items are addressed by index or by their ``name``, and values are parsed as
YAML scalars.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.resources
import inspect
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from tiercache.layout import KVLayout
from tiercache.machine import HOST_MEMORY_SOURCE, cuda_memory_available, host_memory_available
from tiercache.policies import POLICIES, policy_class
from tiercache.tiers import LOCAL_TIER_TYPES, TIER_TYPES, tier_class
from tiercache.validate import (
    MAX_QUEUE_ITEMS,
    FieldError,
    int_in_range,
    non_empty_string,
    number_in_range,
    parse_size,
    positive_timeout_ms,
    queue_size,
    worker_count,
)

ENV_PREFIX = "TIERCACHE_"
MAX_TP_RANK = 1 << 16
"""Largest tensor-parallel rank accepted."""
MAX_ADMIT_AFTER_HITS = 1 << 20
"""Largest ``admit_after_hits``: more hits than that never happen to one block."""
MAX_PREFETCH_MS_PER_1K_TOKENS = 60_000.0
"""Largest per-1k-token growth of the prefetch deadline (a minute per 1k tokens)."""
MAX_YAML_DEPTH_HINT = "a YAML document nested less deeply (the parser ran out of recursion)"
"""What a topology too deeply nested for the parser is told it should be."""
CONVERSION_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)
"""What a dataclass's or a policy's own validation raises for a bad value."""


class ConfigError(ValueError):
    """A configuration problem: where (file, field) and what was expected."""

    def __init__(self, source: str, field_path: str, expected: str, got: Any = dataclasses.MISSING):
        self.source = source
        self.field_path = field_path
        self.expected = expected
        got_text = "" if got is dataclasses.MISSING else f", got {got!r}"
        super().__init__(f"{source}: {field_path or '<top level>'}: expected {expected}{got_text}")


class WritePolicy(enum.Enum):
    """How a tier is filled from the tier above it."""

    WRITE_THROUGH = "write_through"
    """Copy down as soon as the block is in the tier above."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Copy down once the block has been hit ``admit_after_hits`` times (admission control)."""
    WRITE_BACK = "write_back"
    """Copy down only when the tier above evicts the block."""


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


@dataclass
class TierCacheConfig:
    """A validated topology."""

    model: ModelConfig
    layout: KVLayout
    tiers: list[TierConfig]
    exclusive: bool = False
    queues: QueueConfig = field(default_factory=QueueConfig)
    source: str = "<dict>"

    def tier(self, name: str) -> TierConfig:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(tp: Any, value: Any, source: str, path: str) -> Any:
    """Check ``value`` against the type hint ``tp`` and convert (enums, dataclasses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, source, path)
            except ConfigError:
                continue
        raise ConfigError(source, path, _type_name(tp), value)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(source, path, "null", value)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, source, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(source, path, _type_name(tp), value) from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(source, path, "a list", value)
        (item_type,) = typing.get_args(tp) or (Any,)
        return [_convert(item_type, item, source, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(source, path, "a mapping", value)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(source, path, "true or false", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(source, path, "an integer", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(source, path, "a finite number", value) from None
            if math.isfinite(number):
                return number
        raise ConfigError(source, path, "a finite number", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(source, path, "a string", value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(source, path, _type_name(tp), value)


def build_dataclass(cls: type, data: Any, source: str, path: str) -> Any:
    """Build dataclass ``cls`` from a mapping: unknown keys, missing fields and wrong types are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, path, "a mapping", data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                source, f"{prefix}{key}", f"one of the known fields ({allowed}){hint}", "unknown field"
            )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], source, f"{prefix}{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(source, f"{prefix}{name}", f"a value ({_type_name(hints[name])}); it is required")
    try:
        return cls(**kwargs)
    except FieldError as error:
        got = error.got if error.has_value else dataclasses.MISSING
        raise ConfigError(source, f"{prefix}{error.field}", error.expected, got) from None
    except CONVERSION_ERRORS as error:
        raise ConfigError(source, path, f"valid options ({error})") from None


def _validate_tier(tier: TierConfig, index: int, source: str, layout: KVLayout) -> None:
    path = f"tiers[{index}]"
    if tier.type not in TIER_TYPES:
        raise ConfigError(source, f"{path}.type", f"one of {sorted(TIER_TYPES)}", tier.type)
    if tier.name is not None and not tier.name.strip():
        raise ConfigError(source, f"{path}.name", "a non-empty name (or no name: the type is used)", tier.name)
    tier.name = tier.name or tier.type
    if tier.policy not in POLICIES:
        raise ConfigError(source, f"{path}.policy", f"one of {sorted(POLICIES)}", tier.policy)
    if not 1 <= tier.admit_after_hits <= MAX_ADMIT_AFTER_HITS:
        raise ConfigError(
            source, f"{path}.admit_after_hits", f"an integer in [1, {MAX_ADMIT_AFTER_HITS}]", tier.admit_after_hits
        )
    _validate_capacity(tier, path, source, layout)
    _validate_policy_options(tier, path, source)
    options_type = getattr(tier_class(tier.type), "Options", None)
    if options_type is not None:
        tier.options = build_dataclass(options_type, tier.options or {}, source, f"{path}.options")
    elif tier.options:
        raise ConfigError(source, f"{path}.options", f"no options for tier type {tier.type!r}", tier.options)


def _validate_capacity(tier: TierConfig, path: str, source: str, layout: KVLayout) -> None:
    """Sizes parse and are positive; local tiers get ``capacity_blocks`` (memory is checked later)."""
    if tier.capacity_bytes is not None:
        try:
            tier.capacity_bytes = parse_size(tier.capacity_bytes)
        except CONVERSION_ERRORS:
            raise ConfigError(
                source, f"{path}.capacity_bytes", "a size such as 4GiB or an integer", tier.capacity_bytes
            ) from None
        if tier.capacity_bytes <= 0:
            raise ConfigError(source, f"{path}.capacity_bytes", "a positive size", tier.capacity_bytes)
    if tier.capacity_blocks is not None and tier.capacity_blocks <= 0:
        raise ConfigError(source, f"{path}.capacity_blocks", "a positive integer", tier.capacity_blocks)
    if tier.capacity_blocks is not None and tier.capacity_bytes is not None:
        raise ConfigError(source, f"{path}", "capacity_blocks or capacity_bytes, not both")
    if tier.type not in LOCAL_TIER_TYPES:
        return
    if tier.capacity_blocks is None and tier.capacity_bytes is None:
        raise ConfigError(source, f"{path}.capacity_blocks", "a positive integer (or capacity_bytes); it is required")
    if tier.capacity_blocks is None:
        tier.capacity_blocks = tier.capacity_bytes // layout.bytes_per_block
        if tier.capacity_blocks <= 0:
            raise ConfigError(
                source,
                f"{path}.capacity_bytes",
                f"at least one block ({layout.bytes_per_block} bytes)",
                tier.capacity_bytes,
            )


def _validate_policy_options(tier: TierConfig, path: str, source: str) -> None:
    """Unknown options are named; values are checked by constructing the policy itself."""
    cls = policy_class(tier.policy)
    accepted = inspect.signature(cls).parameters
    for option in tier.policy_options:
        if option == "capacity" or option not in accepted:
            known = sorted(p for p in accepted if p != "capacity")
            raise ConfigError(source, f"{path}.policy_options.{option}", f"one of {known}", "unknown option")
    capacity = min(tier.capacity_blocks or 1, MAX_QUEUE_ITEMS)
    try:
        cls(capacity, **tier.policy_options)
    except CONVERSION_ERRORS as error:
        named = [option for option in tier.policy_options if str(option) in str(error)]
        field_path = f"{path}.policy_options" + (f".{named[0]}" if named else "")
        got = tier.policy_options[named[0]] if named else tier.policy_options
        raise ConfigError(source, field_path, f"a valid {tier.policy} option ({error})", got) from None


def _validate_local_memory(config: TierCacheConfig) -> None:
    """The GPU pool and the CPU tier must fit in what this machine can allocate now."""
    source, gpu = config.source, config.tiers[0]
    device_path = "tiers[0].options.device"
    device_name = gpu.options.device
    if device_name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_name)
    host_used = 0
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(source, device_path, "'auto' or 'cpu': CUDA is not available here", device_name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                source, device_path, f"a CUDA device index below {torch.cuda.device_count()}", device_name
            )
        _check_fits(config, 0, 0, cuda_memory_available(device), f"free on {device} (torch.cuda.mem_get_info)")
    else:
        host_used = _check_fits(config, 0, 0, host_memory_available(), f"available on this host ({HOST_MEMORY_SOURCE})")
    if len(config.tiers) > 1 and config.tiers[1].type == "cpu":
        where = f"available on this host ({HOST_MEMORY_SOURCE})"
        if host_used:
            where += f", after the {host_used} bytes of the GPU pool standing in on the CPU"
        _check_fits(config, 1, host_used, host_memory_available(), where)


def _check_fits(config: TierCacheConfig, index: int, already: int, available: int, where: str) -> int:
    """Raise unless tier ``index``'s blocks fit in ``available - already`` bytes; return the bytes it needs."""
    tier, block_bytes = config.tiers[index], config.layout.bytes_per_block
    needed = tier.capacity_blocks * block_bytes
    room = max(0, available - already)
    if needed > room:
        field_name = "capacity_bytes" if tier.capacity_bytes is not None else "capacity_blocks"
        got = tier.capacity_bytes if tier.capacity_bytes is not None else tier.capacity_blocks
        raise ConfigError(
            config.source,
            f"tiers[{index}].{field_name}",
            f"at most {room // block_bytes} blocks of {block_bytes} bytes ({room} bytes {where}); "
            f"this asks for {needed} bytes",
            got,
        )
    return needed


def _validate_hierarchy(config: TierCacheConfig) -> None:
    source, tiers = config.source, config.tiers
    if not tiers:
        raise ConfigError(source, "tiers", "a non-empty list of tiers, the first of type 'gpu'", tiers)
    if tiers[0].type != "gpu":
        raise ConfigError(source, "tiers[0].type", "'gpu' (the first tier is the GPU pool)", tiers[0].type)
    for index, tier in enumerate(tiers[1:], start=1):
        if tier.type == "gpu":
            raise ConfigError(source, f"tiers[{index}].type", "only one 'gpu' tier, and it must be first", tier.type)
        if tier.type == "cpu" and index != 1:
            raise ConfigError(source, f"tiers[{index}].type", "the 'cpu' tier directly after 'gpu'", tier.type)
    if len(tiers) > 2 and tiers[1].type != "cpu":
        raise ConfigError(
            source, "tiers[1].type", "'cpu' (remote tiers stage through the pinned-CPU tier)", tiers[1].type
        )
    seen: set[str] = set()
    for index, tier in enumerate(tiers):
        if tier.name in seen:
            raise ConfigError(source, f"tiers[{index}].name", "a name not used by another tier", tier.name)
        seen.add(tier.name)
    _validate_local_memory(config)


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


def config_from_dict(data: Any, source: str = "<dict>", environ: Mapping[str, str] | None = None) -> TierCacheConfig:
    """Validate a raw mapping (as loaded from YAML) into a ``TierCacheConfig``."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, "", "a mapping with model, layout and tiers", data)
    data = apply_env_overrides(dict(data), environ)
    config = build_dataclass(TierCacheConfig, {**data, "source": source}, source, "")
    for index, tier in enumerate(config.tiers):
        _validate_tier(tier, index, source, config.layout)
    _validate_hierarchy(config)
    return config


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> TierCacheConfig:
    """Read and validate a YAML topology file."""
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
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(source, "document", MAX_YAML_DEPTH_HINT) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "document"
        raise ConfigError(source, where, "valid YAML", str(getattr(error, "problem", error))) from None
    return config_from_dict(data, source, environ)


def default_config_path() -> Path:
    """The embedded default topology (GPU pool + pinned CPU, no server needed)."""
    return Path(str(importlib.resources.files("tiercache.configs").joinpath("default.yaml")))
