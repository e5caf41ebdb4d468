"""The reference side of the miss-ratio-curve checks, shared by the MRC tests and benchmarks/mrc.py.

A Zipf trace of tiercache-like keys, and libCacheSim's exact LRU hit ratio of
the same trace at each multiple of a capacity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import libcachesim as lcs

from tiercache.blocks.keys import KEY_BYTES
from tiercache.testing.policy_traces import Trace, write_oracle_general, zipf

HASHPOWER = 20
"""libCacheSim's initial hash table (2**20 buckets): room for the traces' keys without resizing."""
TRACE_SEED = 15


def block_key(obj_id: int) -> bytes:
    """A tiercache-like key (a BLAKE2b digest) for a trace's object id."""
    return hashlib.blake2b(obj_id.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()


def zipf_keys(accesses: int, key_space: int, alpha: float) -> tuple[Trace, list[bytes]]:
    """A Zipf trace of object ids and the same trace as keys (each distinct id hashed once)."""
    ids = zipf(accesses, n_keys=key_space, alpha=alpha, seed=TRACE_SEED)
    key_of = {obj_id: block_key(obj_id) for obj_id in set(ids)}
    return ids, [key_of[obj_id] for obj_id in ids]


def exact_lru_curve(ids: Trace, path: Path, capacity: int, multiples: Sequence[float]) -> dict[float, float]:
    """libCacheSim's LRU hit ratio of ``ids`` at ``capacity * m`` blocks for each multiple (writes ``path``)."""
    write_oracle_general(ids, path)
    result = {}
    for m in multiples:
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        miss_ratio, _ = lcs.LRU(int(capacity * m), hashpower=HASHPOWER).process_trace(reader)
        result[m] = 1.0 - miss_ratio
    return result
