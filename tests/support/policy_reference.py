"""libCacheSim's side of the policy exactness tests: each policy as libCacheSim builds it, and a trace's miss ratio.

Shared by tests/policies/test_policies.py (the bare policies) and tests/manager/test_gpu_pool_policies.py
(the GPU pool), which compare our decisions with these.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import libcachesim as lcs

from tiercache.testing.policy_traces import Trace

MIN_CACHE_SIZE = 20
"""libCacheSim's S3FIFO admits nothing when its small FIFO holds <= 1 object (c < 20)."""

HASHPOWER = 16
"""libCacheSim's initial hash table is 2**hashpower buckets; the default 24 costs ~0.1 s per cache."""

LIBCACHESIM: dict[str, Callable[..., lcs.CacheBase]] = {
    "lru": lambda c: lcs.LRU(c, hashpower=HASHPOWER),
    "arc": lambda c: lcs.ARC(c, hashpower=HASHPOWER),
    "s3fifo": lambda c, small_ratio=0.1, ghost_ratio=0.9, move_to_main_threshold=2: lcs.S3FIFO(
        c,
        hashpower=HASHPOWER,
        small_size_ratio=small_ratio,
        ghost_size_ratio=ghost_ratio,
        move_to_main_threshold=move_to_main_threshold,
    ),
    "twoq": lambda c, in_ratio=0.25, out_ratio=0.5: lcs.TwoQ(
        c, hashpower=HASHPOWER, a_in_size_ratio=in_ratio, a_out_size_ratio=out_ratio
    ),
}
"""libCacheSim's implementation of each policy, taking our option names."""


def cache_size(trace: Trace, fraction: float) -> int:
    """A cache of ``fraction`` of the trace's distinct keys, never below ``MIN_CACHE_SIZE``."""
    return max(MIN_CACHE_SIZE, int(len(set(trace)) * fraction))


def libcachesim_miss_ratio(cache: lcs.CacheBase, path: Path) -> float:
    """The miss ratio of libCacheSim's ``cache`` on the oracleGeneral trace at ``path``."""
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _byte_miss_ratio = cache.process_trace(reader)
    return miss_ratio
