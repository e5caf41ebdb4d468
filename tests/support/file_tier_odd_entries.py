"""A process that runs a file tier over a directory holding an odd entry, then exits.

Run by tests/tiers/test_file_tier_directory.py: ``python -m support.file_tier_odd_entries DIR ROUNDS``. Each round
puts a batch (the directory is bounded at a few batches, so capacity GC runs), reads it back, asks for
a key nobody wrote (a miss rescans the directory) and runs a GC pass. Prints one JSON line: blocks
offered, stored and read back intact, the answers "cannot tell" to the lookups, and the tier's stats. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from support.file_tier_helpers import BLOCK, RECORD, open_tier
from tiercache.testing.redis_servers import empty_dests, random_blocks
from tiercache.tiers.base import Presence

BATCH = 4
BOUND_BATCHES = 5
"""The directory's bound, in batches: smaller than what the rounds write, so GC removes segments."""


async def main(directory: str, rounds: int) -> None:
    bound = {"max_blocks": None, "max_bytes": BOUND_BATCHES * BATCH * RECORD, "segment_bytes": BATCH * RECORD}
    tier = await open_tier(directory, **bound)
    offered = stored = intact = unknown = 0
    try:
        for seed in range(rounds):
            keys, payloads = random_blocks(BATCH, BLOCK, seed=seed)
            offered += BATCH
            stored += sum(await tier.put(keys, payloads))
            out = empty_dests(BATCH, BLOCK)
            found = await tier.get_into(keys, out)
            intact += sum(ok and bytes(o) == bytes(p) for ok, o, p in zip(found, out, payloads, strict=True))
            answer = await tier.contains(random_blocks(1, BLOCK, seed=rounds + seed)[0])
            unknown += answer.count(Presence.UNKNOWN)
            await tier.gc()
    finally:
        await tier.close()
    result = {"offered": offered, "stored": stored, "intact": intact, "unknown": unknown, "stats": tier.stats()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
