"""Belady's OPT (evict the block whose next use is farthest) over a multi-turn run's block trace.

The oracle row of ``benchmarks/multiturn.py``: the same requests, in the same
order, through a cache of the same capacity that knows the future. A request
saves the prefill of the longest prefix of its blocks that hit (a block helps
only when every block before it is cached too); then all its blocks are
accessed, as the engine stores what it computed. ``plain_miss_ratio`` lets the
benchmark check the eviction decisions against libCacheSim's Belady on the same
trace, in the same run.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

NEVER = math.inf
"""Next use of a block that is not requested again."""


def next_uses(trace: Sequence[int]) -> list[float]:
    """For each position, the position of the same key's next request (``NEVER`` if none)."""
    following: dict[int, float] = {}
    result = [NEVER] * len(trace)
    for position in range(len(trace) - 1, -1, -1):
        key = trace[position]
        result[position] = following.get(key, NEVER)
        following[key] = position
    return result


def belady_hits(trace: Sequence[int], capacity: float) -> list[bool]:
    """Hit or miss of each request through OPT with ``capacity`` blocks (``math.inf``: unbounded)."""
    uses = next_uses(trace)
    resident: dict[int, float] = {}
    farthest: list[tuple[float, int]] = []
    hits = []
    for position, key in enumerate(trace):
        hit = key in resident
        if not hit and len(resident) >= capacity:
            while True:
                negative_use, victim = heapq.heappop(farthest)
                if resident.get(victim) == -negative_use:
                    del resident[victim]
                    break
        resident[key] = uses[position]
        heapq.heappush(farthest, (-uses[position], key))
        hits.append(hit)
    return hits


def prefix_saved_blocks(requests: Sequence[Sequence[int]], capacity: float) -> list[int]:
    """Per request (a sequence of block ids), the blocks of its longest prefix that OPT had cached."""
    trace = [block for request in requests for block in request]
    hits = belady_hits(trace, capacity)
    saved, position = [], 0
    for request in requests:
        flags = hits[position : position + len(request)]
        saved.append(next((i for i, hit in enumerate(flags) if not hit), len(flags)))
        position += len(request)
    return saved


def plain_miss_ratio(trace: Sequence[int], capacity: float) -> float:
    hits = belady_hits(trace, capacity)
    return 1.0 - sum(hits) / max(len(hits), 1)
