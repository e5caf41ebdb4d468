"""KV events for routers: blocks tiercache's CPU tier took from this instance, as vLLM's own ``BlockStored``.

A router that follows vLLM's KV events learns which blocks an instance can serve
from its prefix cache; the connector adds those its CPU tier holds (medium
``CPU``, ownership ``tiercache:<tier>``), named by vLLM's own block hashes so the
router matches them with the GPU's. They are reported once a store has landed in
every worker (``ConnectorScheduler``), only when vLLM's KV events are on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

OWNERSHIP_PREFIX = "tiercache:"


def stored_events(request: Any, positions: Sequence[int], block_size: int, tier: str) -> list[BlockStored]:
    """One ``BlockStored`` per run of consecutive block ``positions`` of ``request`` (those vLLM has hashes for)."""
    hashes = getattr(request, "block_hashes", None) or []
    tokens = request.all_token_ids
    lora = getattr(request, "lora_request", None)
    events: list[BlockStored] = []
    run: list[int] = []
    for position in [p for p in positions if p < len(hashes)] + [-2]:
        if run and position != run[-1] + 1:
            first = run[0]
            events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[p]) for p in run],
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                token_ids=list(tokens[first * block_size : (run[-1] + 1) * block_size]),
                block_size=block_size,
                lora_id=getattr(lora, "lora_int_id", None),
                medium=MEDIUM_CPU,
                lora_name=getattr(lora, "lora_name", None),
                ownership=f"{OWNERSHIP_PREFIX}{tier}",
            ))
            run = []
        if position >= 0:
            run.append(position)
    return events
