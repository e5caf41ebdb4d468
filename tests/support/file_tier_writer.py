"""A separate process writing (and reading back) batches into a shared file-tier directory.

Run by tests/tiers/test_file_tier*.py:
``python -m support.file_tier_writer DIR MAX_BYTES BATCHES BATCH SEED [SEGMENT_BYTES]``
(SEGMENT_BYTES 0: the tier's default; absent: four batches).
It writes ``ready-SEED`` next to DIR, waits for ``go`` (so all writers start
together), writes its batches, then prints how many blocks were stored.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tiercache.testing.redis_servers import random_blocks, remote_context
from tiercache.tiers.file import FileOptions, FileTier

BLOCK = 32 * 1024
GATE_POLL_S = 0.005
"""Pause between looks for the start gate (a gate, not a timing assumption)."""


async def main(directory: str, max_bytes: int, batches: int, batch: int, seed: int, segment_bytes: int = -1) -> None:
    sizing = {} if segment_bytes == 0 else {"segment_bytes": 4 * batch * BLOCK if segment_bytes < 0 else segment_bytes}
    tier = FileTier(remote_context(BLOCK), FileOptions(path=directory, max_bytes=max_bytes, **sizing))
    await tier.start()
    gate = Path(directory).parent
    (gate / f"ready-{seed}").touch()
    while not (gate / "go").exists():
        await asyncio.sleep(GATE_POLL_S)
    stored = 0
    for index in range(batches):
        keys, payloads = random_blocks(batch, BLOCK, seed=seed * 100_000 + index)
        stored += sum(await tier.put(keys, payloads))
    print(stored, flush=True)
    await tier.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], *map(int, sys.argv[2:7])))
