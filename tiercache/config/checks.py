"""Checks of a built topology that span fields or need the machine: capacities, policies, memory.

Called by ``tiercache.config`` once every field has its type: tier types and
policies are looked up (by registered name or module path: the class must be a
``RemoteTier`` / ``EvictionPolicy``), local tiers get their block counts,
``policy_options`` are checked by constructing the policy, and the GPU pool and
CPU tier must fit in the memory this machine has available
(``tiercache.config.machine``) before anything is allocated. The registries, the tier
modules and torch are imported only when a topology is checked, never when
this module is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tiercache.blocks.layout import KVLayout, PageLayout
from tiercache.bookkeeping.admission import WritePolicy
from tiercache.common.fields import MAX_QUEUE_ITEMS, parse_size
from tiercache.common.plugins import PluginError
from tiercache.config.machine import HOST_MEMORY_SOURCE, host_memory_available
from tiercache.config.typed import CONVERSION_ERRORS, ConfigError, build_dataclass

if TYPE_CHECKING:
    from tiercache.config.topology import TierCacheConfig, TierConfig

MAX_ADMIT_AFTER_HITS = 1 << 20
"""Largest ``admit_after_hits``: more hits than that never happen to one block."""
MODULE_PATH_HINT = "or a module path package.module:Class"
"""How a tier type or policy outside the registries is written."""


def _class_of(
    value: str, find: Callable[[str], type], registry: dict[str, str], kind: str, field: str, source: str
) -> type:
    """The class a tier's ``type`` or ``policy`` names: registered, or a module path to a subclass of ``kind``."""
    expected = f"one of {sorted(registry)}, {MODULE_PATH_HINT} of {kind}"
    try:
        return find(value)
    except KeyError:
        raise ConfigError(source, field, expected, value) from None
    except PluginError as error:
        raise ConfigError(source, field, f"{expected} ({error})", value) from None


def validate_tier(tier: TierConfig, index: int, source: str, layout: KVLayout | PageLayout | None) -> None:
    """Check one tier in place: type, name, policy and its options, capacity, and build its ``Options``.

    ``layout`` sizes local tiers given in bytes; None for a remote-only topology (remote tiers never read it).
    """
    from tiercache.policies import POLICIES, policy_class
    from tiercache.tiers import LOCAL_TIER_TYPES, TIER_TYPES, default_tier_name, tier_class

    path = f"tiers[{index}]"
    cls = _class_of(tier.type, tier_class, TIER_TYPES, "a RemoteTier subclass", f"{path}.type", source)
    if tier.name is not None and not tier.name.strip():
        raise ConfigError(source, f"{path}.name", "a non-empty name (or no name: the type is used)", tier.name)
    tier.name = tier.name or default_tier_name(tier.type)
    policy = _class_of(tier.policy, policy_class, POLICIES, "an EvictionPolicy subclass", f"{path}.policy", source)
    if not 1 <= tier.admit_after_hits <= MAX_ADMIT_AFTER_HITS:
        raise ConfigError(
            source, f"{path}.admit_after_hits", f"an integer in [1, {MAX_ADMIT_AFTER_HITS}]", tier.admit_after_hits
        )
    if tier.type in LOCAL_TIER_TYPES and tier.codec.lossy:
        raise ConfigError(source, f"{path}.codec", "the exact level only (the GPU and CPU tiers keep exact KV)",
                          [level.value for level in tier.codec.levels])
    _validate_capacity(tier, path, source, layout)
    _validate_policy_options(tier, policy, path, source)
    options_type = getattr(cls, "Options", None)
    if options_type is not None:
        tier.options = build_dataclass(options_type, tier.options or {}, source, f"{path}.options")
    elif tier.options:
        raise ConfigError(source, f"{path}.options", f"no options for tier type {tier.type!r}", tier.options)


def _validate_capacity(tier: TierConfig, path: str, source: str, layout: KVLayout | PageLayout | None) -> None:
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
    from tiercache.tiers import LOCAL_TIER_TYPES

    if tier.type not in LOCAL_TIER_TYPES:
        return
    assert layout is not None, "local tiers are validated with the topology's layout"
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


def _validate_policy_options(tier: TierConfig, cls: type, path: str, source: str) -> None:
    """Unknown options are named; values are checked by constructing the policy itself."""
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


def _validate_below_engine_pool(config: TierCacheConfig) -> None:
    """Tiers under an engine's own GPU pool: the CPU tier first, then remotes; it must fit in host memory."""
    source, tiers = config.source, config.tiers
    if not tiers or tiers[0].type != "cpu":
        got = tiers[0].type if tiers else tiers
        raise ConfigError(source, "tiers[0].type", "'cpu' (the engine keeps its own GPU pool; tiercache's first "
                          "tier is the CPU tier below it)", got)
    for index, tier in enumerate(tiers[1:], start=1):
        if tier.type in ("gpu", "cpu"):
            expected = "a remote tier type (the CPU tier comes first)"
            raise ConfigError(source, f"tiers[{index}].type", expected, tier.type)
    if tiers[0].write_policy is WritePolicy.WRITE_BACK:
        expected = "write_through or write_through_selective (the engine's evictions from its own pool are not seen)"
        raise ConfigError(source, "tiers[0].write_policy", expected, tiers[0].write_policy.value)
    validate_unique_names(tiers, source)
    _check_fits(config, 0, 0, host_memory_available(), f"available on this host ({HOST_MEMORY_SOURCE})")


def _validate_local_memory(config: TierCacheConfig) -> None:
    """The GPU pool and the CPU tier must fit in what this machine can allocate now."""
    device = _cuda_device(config)
    host_used = 0
    if device is not None:
        from tiercache.config.machine import cuda_memory_available

        _check_fits(config, 0, 0, cuda_memory_available(device), f"free on {device} (torch.cuda.mem_get_info)")
    else:
        host_used = _check_fits(config, 0, 0, host_memory_available(), f"available on this host ({HOST_MEMORY_SOURCE})")
    _validate_cpu_tier_memory(config, host_used)


def _cuda_device(config: TierCacheConfig) -> Any:
    """The CUDA device the GPU pool will use (a checked ``torch.device``), or None when it stays on the CPU.

    torch is imported only here, and only for a device other than ``cpu``.
    """
    source, device_name = config.source, config.tiers[0].options.device
    device_path = "tiers[0].options.device"
    if device_name == "cpu":
        return None
    import torch

    if device_name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_name)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ConfigError(source, device_path, "'auto' or 'cpu': CUDA is not available here", device_name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(source, device_path, f"a CUDA device index below {torch.cuda.device_count()}", device_name)
    return device


def _validate_cpu_tier_memory(config: TierCacheConfig, host_used: int) -> None:
    """The CPU tier must fit in host memory, after ``host_used`` bytes of a GPU pool kept on the CPU."""
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


def validate_unique_names(tiers: Sequence[TierConfig], source: str) -> None:
    """No two tiers share a name (stats, events and overrides address tiers by it)."""
    seen: set[str] = set()
    for index, tier in enumerate(tiers):
        if tier.name in seen:
            raise ConfigError(source, f"tiers[{index}].name", "a name not used by another tier", tier.name)
        seen.add(tier.name)


def validate_hierarchy(config: TierCacheConfig, *, engine_pool: bool = False) -> None:
    """Check the order and names of the tiers, then that the local tiers fit in this machine's memory.

    ``engine_pool``: the engine keeps its own GPU pool (``LowerTiers``), so the first tier is the CPU tier.
    """
    source, tiers = config.source, config.tiers
    if engine_pool:
        _validate_below_engine_pool(config)
        return
    if isinstance(config.layout, PageLayout):  # opaque pages: attention cannot read them from a pool
        raise ConfigError(source, "layout", "num_layers, num_kv_heads and head_dim (a GPU pool holds K/V per layer; "
                          "a layout of block_bytes is for an engine that keeps its own pool)", "block_bytes")
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
    validate_unique_names(tiers, source)
    _validate_local_memory(config)
