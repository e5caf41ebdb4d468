"""LowerTiers over a coded Redis tier: the per-level counts it reads out, and the recompute estimate a coded read asks
for, which comes through the books' one lock."""

from __future__ import annotations

import threading
from typing import Any

import redis
import torch
from support.lower_tiers_helpers import LAYOUT, WAIT_S, chain, lower_config, settled_lookup, started, until

from tiercache.config import config_from_dict
from tiercache.manager.lower_tiers import LowerTiers
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.coded import CodedTier

BLOCKS = 3
PREFILL_TOKENS, PREFILL_SECONDS = 1000, 2.0
"""An observed prefill rate: 500 tokens a second."""


def int8_redis(url: str, adaptive: bool = False) -> dict[str, Any]:
    codec = {"levels": ["int8", "exact"] if adaptive else ["int8"], "adaptive": adaptive}
    return {"type": "redis", "name": "redis", "options": {"url": url}, "codec": codec}


def write_kv(tiers: LowerTiers, keys: list[bytes]) -> None:
    """The engine's store of real float32 KV (int8 needs numbers, not random bytes)."""
    slots = tiers.begin_writes(keys)
    assert None not in slots
    for slot in slots:
        assert slot is not None
        tiers.buffer_view(slot)[:] = torch.randn(tiers.bytes_per_block // 4).numpy().tobytes()
    tiers.end_writes(keys, [slot for slot in slots if slot is not None], [True] * len(keys))


def test_level_blocks_reads_out_what_the_coded_reads_filled(
    opened: list[LowerTiers], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    writer = started(lower_config(remotes=[int8_redis(redis_server.url)]), opened)
    keys = chain(writer, BLOCKS, salt=1)
    write_kv(writer, keys)
    until(lambda: redis_client.dbsize() == BLOCKS)
    reader = started(lower_config(remotes=[int8_redis(redis_server.url)]), opened)
    assert reader.level_blocks() == {}, "nothing read yet"
    fetch = reader.fetch(settled_lookup(reader, keys))
    until(fetch.ready)
    assert len(fetch.slots()) == BLOCKS
    fetch.release()
    assert reader.level_blocks() == {"int8": BLOCKS}
    assert writer.level_blocks() == {}, "a writer reads nothing"


def test_a_coded_reads_recompute_estimate_is_the_cost_models_taken_under_the_books_lock(
    opened: list[LowerTiers], redis_server: RedisServer
) -> None:
    data = {"model": {"id": "lower-tiers"}, "layout": LAYOUT, "cost": {"enabled": True},
            "tiers": [{"type": "cpu", "capacity_blocks": 4}, int8_redis(redis_server.url, adaptive=True)]}
    tiers = started(config_from_dict(data, environ={}, engine_pool=True), opened)
    coded = next(tier for tier in tiers.parts.remotes if isinstance(tier, CodedTier))
    assert coded.recompute_seconds is not None
    assert coded.recompute_seconds(16) is None, "no prefill rate known yet"
    tiers.observe_prefill(PREFILL_TOKENS, PREFILL_SECONDS)
    answers: list[float | None] = []
    asked = threading.Thread(target=lambda: answers.append(coded.recompute_seconds(16)), daemon=True)
    with tiers.parts.books.lock:  # another thread's bookkeeping in progress
        asked.start()
        asked.join(0.05)
        assert answers == [], "the estimate was read while the books' lock was held elsewhere"
    asked.join(WAIT_S)
    assert answers == [16 * PREFILL_SECONDS / PREFILL_TOKENS]
