"""The remote tiers of a topology: built, started, closed and described the same way by every owner.

``Stack`` (the ``TierManager``'s and ``LowerTiers``' parts), ``RemoteStore`` (the
remote-only API for engines with their own GPU and CPU tiers) and ``inspect``
(``tiercache inspect``) key the namespace with ``model.secret_env``'s secret when
one is named (its keys and values then depend on it) and build each remote tier
with its options and the namespace's codec, through these functions. The stack
and the store give each tier one transfer-queue lane (limiter, breaker,
deadlines), report its counters the same way and close it within a deadline;
``LowerTiers`` and ``RemoteStore`` wait at most ``START_TIMEOUT_S`` for their
tiers to start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from tiercache.blocks.codec import Codec
from tiercache.blocks.keys import Namespace
from tiercache.blocks.layout import KVLayout, PageLayout
from tiercache.blocks.namespaces import engine_namespace
from tiercache.codecs.coding import KVCoding
from tiercache.codecs.geometry import KVGeometry, UnsupportedPages
from tiercache.codecs.levels import CodecConfig, Level
from tiercache.codecs.tables import load_tables
from tiercache.common.units import MS_PER_SECOND
from tiercache.config.topology import QueueConfig, TierCacheConfig, TierConfig
from tiercache.config.typed import ConfigError
from tiercache.movement.lanes import Lane
from tiercache.movement.runtime import Runtime
from tiercache.remote.secret import keyed_namespace
from tiercache.telemetry.counters import Metrics
from tiercache.tiers import tier_class
from tiercache.tiers.base import RemoteContext, RemoteTier
from tiercache.tiers.coded import CodedTier

log = logging.getLogger(__name__)

START_TIMEOUT_S = 5.0
"""How long a start waits for the remote tiers to connect before going on without them (an unreachable store
is not an error: it reads as misses)."""
CLOSE_REMOTE_SECONDS = 2.0
"""How long the remote tiers' own ``close`` may take before they are abandoned."""


def topology_namespace(namespace: Namespace, secret_env: str | None, source: str) -> tuple[Namespace, Codec]:
    """``namespace`` keyed with the secret in ``$secret_env`` when one is named, and the codec of its values.

    A keyed namespace's keys depend on its secret (``tiercache.remote.secret``); a missing
    or malformed secret is a ``ConfigError`` naming ``model.secret_env``.
    """
    if secret_env is None:
        return keyed_namespace(namespace, None)
    try:
        return keyed_namespace(namespace, os.environ.get(secret_env, "").encode())
    except ValueError as error:
        expected = f"environment variable {secret_env} set to a secret"
        raise ConfigError(source, "model.secret_env", expected, str(error)) from None


def model_namespace(config: TierCacheConfig) -> tuple[Namespace, Codec]:
    """A topology's namespace (model, layout, rank, tenant, LoRA; keyed with ``model.secret_env``'s secret
    when set, so its keys depend on it) and the codec of its values."""
    model = config.model
    namespace = engine_namespace(model.id, config.layout.page_format(), model.tp_rank, tenant=model.tenant,
                                 lora=model.lora)
    return topology_namespace(namespace, model.secret_env, config.source)


def build_tier(
    tier: TierConfig, codec: Codec, block_bytes: int, layout: KVLayout | PageLayout | None = None,
    source: str = "<topology>",
) -> RemoteTier:
    """One remote tier of a topology, with its options and the namespace's codec (not started); a tier whose
    ``codec`` lists lossy levels is wrapped in a ``CodedTier`` for ``layout``'s values. A level that cannot read
    the blocks (any lossy level on opaque pages or no layout; ``compact`` on an engine's pages, known only as groups
    of elements) is declined with a log line saying why; with no lossy level left the tier stores exact KV."""
    cls = tier_class(tier.type)
    if not tier.codec.lossy:
        return cls(RemoteContext(tier.name, codec, block_bytes), tier.options)
    try:
        geometry = KVGeometry.of(layout if layout is not None else PageLayout(block_bytes))
    except UnsupportedPages as why:
        log.warning("tier %s: codec levels %s declined, storing exact KV: %s", tier.name,
                    [level.value for level in tier.codec.levels], why)
        return cls(RemoteContext(tier.name, codec, block_bytes), tier.options)
    config = _readable_levels(tier, geometry)
    if config is None:
        return cls(RemoteContext(tier.name, codec, block_bytes), tier.options)
    tables = None
    if Level.COMPACT in config.levels:
        try:
            tables = load_tables(str(tier.codec.tables))
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(source, f"tiers.{tier.name}.codec.tables", "a tables file tiercache wrote",
                              str(error)) from None
    try:
        coding = KVCoding(geometry, config.levels, tables)
    except ValueError as error:
        raise ConfigError(source, f"tiers.{tier.name}.codec.tables", "tables learned for this layout",
                          str(error)) from None
    inner = cls(RemoteContext(tier.name, codec.reading(coding), block_bytes), tier.options)
    return CodedTier(inner, coding, config)


def _readable_levels(tier: TierConfig, geometry: KVGeometry) -> CodecConfig | None:
    """``tier``'s codec without the levels ``geometry``'s blocks refuse (each logged); None when no lossy level is
    left (the tier then stores exact KV, logged)."""
    refused = {level: why for level in tier.codec.levels if (why := geometry.unreadable(level)) is not None}
    if not refused:
        return tier.codec
    for level, why in refused.items():
        log.warning("tier %s: codec level %s declined: %s", tier.name, level.value, why)
    kept = [level for level in tier.codec.levels if level not in refused]
    if not any(level.lossy for level in kept):
        log.warning("tier %s: no lossy codec level left, storing exact KV", tier.name)
        return None
    return dataclasses.replace(tier.codec, levels=kept)


def build_remotes(
    tiers: Sequence[TierConfig], codec: Codec, block_bytes: int, queues: QueueConfig, metrics: Metrics,
    layout: KVLayout | PageLayout | None = None, source: str = "<topology>",
) -> tuple[list[RemoteTier], list[Lane]]:
    """The remote tiers of a topology and one lane each (limiter, breaker, deadlines), fastest first."""
    remotes = [build_tier(tier, codec, block_bytes, layout, source) for tier in tiers]
    timeout_s = queues.remote_lookup_timeout_ms / MS_PER_SECOND
    lanes = [Lane(i, tier, queues.transfer_concurrency, metrics, timeout_s) for i, tier in enumerate(remotes)]
    return remotes, lanes


async def close_remotes(
    runtime: Runtime, remotes: Sequence[RemoteTier], drain_s: float = CLOSE_REMOTE_SECONDS
) -> None:
    """On the loop: let tracked work finish within ``drain_s``, then close every tier within
    ``CLOSE_REMOTE_SECONDS``."""
    await runtime.drain(drain_s)
    closing = [asyncio.ensure_future(tier.close()) for tier in remotes]
    if closing:
        await asyncio.wait(closing, timeout=CLOSE_REMOTE_SECONDS)


def lane_stats(lane: Lane) -> dict[str, Any]:
    """A remote tier's breaker (its lane's: state and openings) and the tier's own counters (empty when it fails
    to say; a tier with several servers reports their breakers there)."""
    try:
        own = dict(lane.tier.stats())
    except Exception:
        own = {}
    return {"lane_breaker_state": int(lane.breaker.state), "lane_breaker_opened": lane.breaker.opened, "store": own}
