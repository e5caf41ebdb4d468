"""A connection cut in the middle of a value is dropped and replaced; the server is not failing.

A ``CutProxy`` in front of a real redis-server resets connections mid-value (5%
of the values it forwards are the one their connection is cut in). Every block
must still be served, byte for byte, with no call counted against the tier's
breaker (its transfer lane's): the connection's lane re-sends what was not
answered on a fresh connection, and never reads a reply stream it has lost
track of.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch
from support.manager_helpers import block_kv, compute_and_store, read_block, topology, until
from support.proxies import CutProxy

from tiercache.blocks.value_format import HEADER_SIZE
from tiercache.manager.tier_manager import TierManager
from tiercache.testing.redis_servers import empty_dests, random_blocks, remote_context
from tiercache.tiers.base import CallReport, report_calls_into
from tiercache.tiers.redis import RedisOptions, RedisTier

CUT_FRACTION = 0.05
BLOCK = 64 * 1024
BLOCKS = 128
BATCH = 32
ROUNDS = 12
WAIT_S = 30.0
"""A hang detector for background work, never a speed judgement."""


def reply_bytes(block_bytes: int) -> int:
    """The bytes of one GET reply carrying a block: reply line, header, payload, CRLF."""
    value = HEADER_SIZE + block_bytes
    return len(b"$%d\r\n" % value) + value + 2


async def test_cut_connections_are_replaced_and_every_block_is_served(redis_server: Any) -> None:
    keys, payloads = random_blocks(BLOCKS, BLOCK)
    writer = RedisTier(remote_context(BLOCK), RedisOptions(url=redis_server.url))
    await writer.start()
    try:
        assert all(await writer.put(keys, payloads))
    finally:
        await writer.close()
    with CutProxy(redis_server.port, CUT_FRACTION, reply_bytes(BLOCK)) as proxy:
        tier = RedisTier(remote_context(BLOCK), RedisOptions(url=proxy.url))
        await tier.start()
        told = CallReport()
        report_calls_into(told)  # what the tier tells its lane's breaker, as a lane would hear it
        try:
            for round_ in range(ROUNDS):
                batches = [list(range(start, BLOCKS, BLOCKS // BATCH)) for start in range(BLOCKS // BATCH)]
                dests = [empty_dests(len(batch), BLOCK) for batch in batches]
                results = await asyncio.gather(
                    *(tier.get_into([keys[i] for i in batch], out) for batch, out in zip(batches, dests, strict=True))
                )
                for batch, out, oks in zip(batches, dests, results, strict=True):
                    assert all(oks), f"round {round_}: {oks.count(False)} of {len(oks)} blocks not served"
                    assert all(bytes(out[j]) == bytes(payloads[i]) for j, i in enumerate(batch))
            stats = tier.stats()
        finally:
            await tier.close()
    assert proxy.cuts > 0, "the proxy must have cut connections"
    assert told.server_failed is None, "a cut connection is not a failing server"
    assert "breaker_opened" not in stats, "a single server's breaker is its lane's"
    assert stats["connections_replaced"] == proxy.cuts
    assert stats["connects"] == proxy.connections


MANAGER_LAYOUT = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": 16}
PROMPTS = 16
PROMPT_BLOCKS = 8


def test_cut_connections_cost_the_engine_no_blocks(redis_server: Any) -> None:
    """Through the manager: lookups and loads behind the cutting proxy load every block, right."""

    def config(url: str, cpu_blocks: int) -> Any:
        remote = {"name": "redis", "type": "redis", "write_policy": "write_through",
                  "options": {"url": url, "allow_unbounded": True}}
        return topology(2 * PROMPT_BLOCKS, cpu_blocks, layout=MANAGER_LAYOUT, remotes=[remote])

    block_tokens = MANAGER_LAYOUT["block_size"]
    prompts = [np.arange(PROMPT_BLOCKS * block_tokens) + 100_000 * i for i in range(PROMPTS)]
    with TierManager(config(redis_server.url, PROMPTS * PROMPT_BLOCKS)) as writer:
        for prompt in prompts:
            compute_and_store(writer, prompt)
        until(lambda: int(redis_server.cli("DBSIZE")) == PROMPTS * PROMPT_BLOCKS, WAIT_S)
        value_bytes = reply_bytes(writer.layout.bytes_per_block)
    with (
        CutProxy(redis_server.port, CUT_FRACTION, value_bytes) as proxy,
        TierManager(config(proxy.url, PROMPT_BLOCKS)) as reader,
    ):
        for _ in range(ROUNDS):
            for prompt in prompts:
                hit = reader.lookup_wait(prompt, timeout_s=WAIT_S)
                assert hit.tier_blocks["redis"] == PROMPT_BLOCKS
                ids = reader.allocate(PROMPT_BLOCKS)
                assert reader.load(hit, ids).result(WAIT_S) == PROMPT_BLOCKS * block_tokens
                keys = reader.hasher.keys(prompt)
                assert all(torch.equal(read_block(reader, ids[i]), block_kv(reader, keys[i])) for i in range(len(ids)))
                reader.release(ids)
        lane = reader.stats()["tiers"]["redis"]
    assert proxy.cuts > 0, "the proxy must have cut connections"
    assert lane["lane_breaker_opened"] == 0 and lane.get("server_failures", 0) == 0
