"""Checksums taken once: a block copied into the CPU tier is hashed there, and every remote write carries it.

Through the manager, with two write-through remotes (Redis and files): each put
carries the slot's checksum, the stored headers hold the xxh3-64 of the stored
bytes (checked here with ``xxhash`` itself, not the codec), and another manager
reads every block back byte-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
import xxhash
from support.manager_helpers import block_kv, compute_and_store, read_block, topology, until

from tiercache.blocks.value_format import CHECKSUM, CHECKSUM_OFFSET, HEADER_SIZE
from tiercache.manager.tier_manager import TierManager

BLOCKS = 6
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_size": 4}


def config(redis_url: str, directory: Path) -> Any:
    remotes = [
        {"name": "redis", "type": "redis", "write_policy": "write_through",
         "options": {"url": redis_url, "allow_unbounded": True}},
        {"name": "files", "type": "file", "write_policy": "write_through",
         "options": {"path": str(directory), "max_bytes": "64MB"}},
    ]
    return topology(2 * BLOCKS, 2 * BLOCKS, layout=LAYOUT, remotes=remotes)


def test_every_remote_write_of_a_copied_block_carries_its_checksum(redis_server: Any, tmp_path: Path) -> None:
    tokens = np.arange(BLOCKS * LAYOUT["block_size"]) + 700_000
    with TierManager(config(redis_server.url, tmp_path)) as writer:
        keys = writer.hasher.keys(tokens)
        compute_and_store(writer, tokens)
        until(lambda: writer.stats()["queues"]["pending_stores"] == 0)
        tiers = writer.stats()["tiers"]
        assert tiers["redis"]["put_checksums_carried"] == BLOCKS
        assert tiers["files"]["put_checksums_carried"] == BLOCKS
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    values = [client.get(name) for name in client.keys("*")]
    client.close()
    assert len(values) == BLOCKS
    for value in values:
        assert value is not None
        stored = value[HEADER_SIZE:]
        assert CHECKSUM.unpack_from(value, CHECKSUM_OFFSET)[0] == xxhash.xxh3_64_intdigest(stored)
    with TierManager(config(redis_server.url, tmp_path)) as reader:
        hit = reader.lookup_wait(tokens, timeout_s=10.0)
        ids = reader.allocate(BLOCKS)
        assert reader.load(hit, ids).result(10.0) == BLOCKS * LAYOUT["block_size"]
        for key, block in zip(keys, ids, strict=True):
            assert torch.equal(read_block(reader, block), block_kv(reader, key))
