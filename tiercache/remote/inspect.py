"""``tiercache inspect``: a topology as validated, and whether each remote tier, and each of its servers, answers.

Each remote tier is built the way the stack builds it (``build``), started,
made to write, find and delete one check block under a timeout, asked for its
servers apart (``RemoteTier.check_reachability``: central and region, a
cluster's nodes) and closed. Nothing raises: a tier that cannot be built, an
unreachable server or a timeout is a line of the report with its cause (the
tier's ``last_error``, a server's reply).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from tiercache.blocks.keys import BlockHasher
from tiercache.common.units import MS_PER_SECOND
from tiercache.config.topology import TierCacheConfig
from tiercache.remote.build import build_tier, model_namespace
from tiercache.tiers.base import Presence, RemoteTier, ServerReachability

CHECK_TIMEOUT_S = 2.0
"""How long ``inspect`` waits for each remote operation before calling the tier unreachable."""
COLUMNS = (("name", 12), ("type", 11), ("policy", 9))
"""The tier table's first columns (``TierConfig`` fields) and their least widths."""
CHECK_EXTRA = "tiercache-inspect"
"""The key ``extra`` of the check block, so it never names a block an engine stores."""
log = logging.getLogger(__name__)


def _capacity_text(blocks: int | None, block_bytes: int) -> str:
    if blocks is None:
        return "bounded by the store"
    return f"{blocks} blocks = {blocks * block_bytes / 2**20:.1f} MiB"


def _server_lines(servers: list[ServerReachability]) -> str:
    """One indented line per server checked apart."""
    return "".join(
        f"\n    {s.role:<10}{'reachable' if s.ok else 'UNREACHABLE':<13}{s.where}: {s.detail}" for s in servers
    )


async def check_remote(tier: RemoteTier, key: bytes, timeout: float = CHECK_TIMEOUT_S) -> tuple[bool, str]:
    """Start the tier, write, find and delete a check block, check its servers apart, close it; (reachable,
    detail). Never raises; a failure names its cause (the tier's ``last_error``, a failed server's detail)."""
    started = time.perf_counter()
    servers: list[ServerReachability] = []
    try:
        await asyncio.wait_for(tier.start(), timeout)
        written = await asyncio.wait_for(tier.put([key], [memoryview(bytes(tier.block_bytes))]), timeout)
        found = await asyncio.wait_for(tier.contains([key]), timeout)
        await asyncio.wait_for(tier.delete([key]), timeout)
        servers = await asyncio.wait_for(tier.check_reachability(key), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        cause = f" (last error: {tier.last_error})" if tier.last_error else ""
        return False, f"no answer within {timeout:.1f}s{cause}"
    except Exception as error:
        return False, f"{type(error).__name__}: {error}"
    finally:
        try:
            await asyncio.wait_for(tier.close(), timeout)
        except Exception as error:
            log.warning("inspect: closing %s failed: %s", tier.name, error)
    elapsed_ms = (time.perf_counter() - started) * MS_PER_SECOND
    lines = _server_lines(servers)
    failed = [server for server in servers if not server.ok]
    if failed:
        return False, "; ".join(f"{server.role} {server.where}: {server.detail}" for server in failed) + lines
    if written == [True] and found == [Presence.HELD]:
        return True, f"put/contains/delete of a check block ok in {elapsed_ms:.1f} ms" + lines
    read_back = "ok" if found == [Presence.HELD] else "failed"
    cause = f" ({tier.last_error})" if tier.last_error else ""
    return False, f"check write {'ok' if written == [True] else 'failed'}, read back {read_back}{cause}" + lines


def inspect_topology(config: TierCacheConfig, timeout: float = CHECK_TIMEOUT_S) -> tuple[str, bool]:
    """A report of the validated topology and its remotes' reachability, and whether every remote answered."""
    layout, model = config.layout, config.model
    namespace, codec = model_namespace(config)
    lines = [
        f"topology: {config.source}",
        f"model: {model.id} (tp rank {model.tp_rank}, tenant {model.tenant}, lora {model.lora})"
        + (f"; keyed by {model.secret_env}, key id {namespace.key_id.hex()}" if namespace.key_id else ""),
        f"layout: {layout.num_layers} layers x {layout.num_kv_heads} kv heads x {layout.head_dim} dims, "
        f"{layout.dtype}, {layout.block_size} tokens/block, {layout.memory.value}: "
        f"{layout.bytes_per_block} bytes per block; page format {namespace.page_format}",
        f"exclusive: {config.exclusive}; queues: "
        + ", ".join(f"{k} {getattr(v, 'value', v)}" for k, v in dataclasses.asdict(config.queues).items()),
    ]
    # columns as wide as their longest entry (a plug-in's module path, a long tier name)
    name_w, type_w, policy_w = (max(w, *(len(getattr(t, f)) + 1 for t in config.tiers)) for f, w in COLUMNS)
    lines.append(f"{'tier':<{name_w}}{'type':<{type_w}}{'policy':<{policy_w}}{'write policy':<25}capacity")
    for tier in config.tiers:
        blocks = tier.capacity_blocks
        if blocks is None:
            blocks = getattr(tier.options, "capacity_blocks", None) or None
        lines.append(
            f"{tier.name:<{name_w}}{tier.type:<{type_w}}{tier.policy:<{policy_w}}{tier.write_policy.value:<25}"
            f"{_capacity_text(blocks, layout.bytes_per_block)}"
        )
    remotes = [t for t in config.tiers if t.type not in ("gpu", "cpu")]
    all_ok = True
    if remotes:
        key = BlockHasher(namespace, layout.block_size).keys([0] * layout.block_size, CHECK_EXTRA)[0]
        lines.append("connectivity:")
        for tier_config in remotes:
            try:
                tier = build_tier(tier_config, codec, layout.bytes_per_block)
            except Exception as error:
                ok, detail = False, f"could not build the tier: {type(error).__name__}: {error}"
            else:
                ok, detail = asyncio.run(check_remote(tier, key, timeout))
            all_ok &= ok
            lines.append(f"  {tier_config.name:<12}{'reachable' if ok else 'UNREACHABLE':<13}{detail}")
    return "\n".join(lines), all_ok
