"""Synthetic block-key traces shared by the policy tests and the policy, multi-turn and MRC benchmarks.

Each generator is deterministic for a given seed and returns a list of positive
ints (libCacheSim object ids), so the same trace can be replayed by our policies
in Python and by libCacheSim's C simulator from an oracleGeneral file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

Trace = list[int]

FIRST_KEY = 1
"""Smallest key a generator emits (libCacheSim reserves nothing, but 0 reads as 'unset')."""

ORACLE_GENERAL_DTYPE = np.dtype(
    [("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access_vtime", "<i8")]
)
"""libCacheSim's oracleGeneral record: packed little-endian, 24 bytes."""

NO_NEXT_ACCESS = -1
"""oracleGeneral's marker for 'never requested again' (Belady reads it)."""


def zipf(n_requests: int, n_keys: int, alpha: float, seed: int) -> Trace:
    """Independent requests whose popularity follows Zipf(alpha) over ``n_keys`` keys."""
    rng = np.random.default_rng(seed)
    return _zipf_keys(rng, n_requests, n_keys, alpha).tolist()


def zipf_with_scans(
    n_requests: int,
    n_keys: int,
    alpha: float,
    scan_every: int,
    scan_length: int,
    seed: int,
) -> Trace:
    """Zipf requests interrupted every ``scan_every`` requests by a scan of one-time keys.

    The scans model a long prompt that is read once (a document, a tool output):
    each scan key is new and never requested again, which flushes LRU's hot set
    but should not flush a scan-resistant policy's.
    """
    rng = np.random.default_rng(seed)
    hot = _zipf_keys(rng, n_requests, n_keys, alpha).tolist()
    trace: Trace = []
    next_scan_key = FIRST_KEY + n_keys
    for start in range(0, len(hot), scan_every):
        trace.extend(hot[start : start + scan_every])
        trace.extend(range(next_scan_key, next_scan_key + scan_length))
        next_scan_key += scan_length
    return trace[:n_requests]


def multi_turn_chat(
    n_requests: int,
    n_active: int,
    n_system_prompts: int,
    system_prompt_blocks: int,
    blocks_per_turn: int,
    turns_per_conversation: int,
    alpha: float,
    seed: int,
) -> Trace:
    """Multi-turn chat: each turn requests its conversation's whole prefix, then new blocks.

    Keys chain (docs/architecture.md, "Key"): a conversation's prefix is one of a few shared system
    prompts followed by blocks private to that conversation, so a turn requests
    the system prompt's keys, every block of the earlier turns, and
    ``blocks_per_turn`` new keys. ``n_active`` conversations are open at a time;
    which one speaks next is Zipf(alpha), and one that reaches
    ``turns_per_conversation`` turns is replaced by a new conversation.
    """
    rng = np.random.default_rng(seed)
    system_prompts = [
        list(range(FIRST_KEY + p * system_prompt_blocks, FIRST_KEY + (p + 1) * system_prompt_blocks))
        for p in range(n_system_prompts)
    ]
    next_key = FIRST_KEY + n_system_prompts * system_prompt_blocks
    prompt_of = rng.integers(0, n_system_prompts, size=n_active).tolist()
    history: list[list[int]] = [[] for _ in range(n_active)]
    trace: Trace = []
    while len(trace) < n_requests:
        slot = int(_zipf_keys(rng, 1, n_active, alpha)[0]) - FIRST_KEY
        if len(history[slot]) >= turns_per_conversation * blocks_per_turn:
            history[slot] = []
            prompt_of[slot] = int(rng.integers(0, n_system_prompts))
        trace.extend(system_prompts[prompt_of[slot]])
        trace.extend(history[slot])
        new_blocks = list(range(next_key, next_key + blocks_per_turn))
        next_key += blocks_per_turn
        trace.extend(new_blocks)
        history[slot].extend(new_blocks)
    return trace[:n_requests]


def _zipf_keys(rng: np.random.Generator, n_requests: int, n_keys: int, alpha: float) -> np.ndarray:
    """``n_requests`` keys in [FIRST_KEY, FIRST_KEY + n_keys), P(rank r) ∝ r**-alpha, ranks shuffled."""
    weights = np.arange(1, n_keys + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(n_requests) * cdf[-1], side="right")
    ranks = np.minimum(ranks, n_keys - 1)
    return rng.permutation(n_keys)[ranks] + FIRST_KEY


def next_access_vtimes(trace: Sequence[int]) -> np.ndarray:
    """For each request, the index of the next request for the same key (or NO_NEXT_ACCESS)."""
    result = np.full(len(trace), NO_NEXT_ACCESS, dtype=np.int64)
    seen: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        key = trace[i]
        result[i] = seen.get(key, NO_NEXT_ACCESS)
        seen[key] = i
    return result


def write_oracle_general(trace: Sequence[int], path: Path) -> Path:
    """Write ``trace`` as unit-size requests in libCacheSim's oracleGeneral binary format."""
    records = np.zeros(len(trace), dtype=ORACLE_GENERAL_DTYPE)
    records["clock_time"] = np.arange(len(trace), dtype=np.uint32)
    records["obj_id"] = np.asarray(trace, dtype=np.uint64)
    records["obj_size"] = 1
    records["next_access_vtime"] = next_access_vtimes(trace)
    records.tofile(path)
    return path


TRACES: dict[str, Callable[[int], Trace]] = {
    "zipf": lambda n: zipf(n, n_keys=n // 10, alpha=0.9, seed=1),
    "zipf_scan": lambda n: zipf_with_scans(
        n, n_keys=n // 20, alpha=1.0, scan_every=n // 50, scan_length=n // 100, seed=2
    ),
    "chat": lambda n: multi_turn_chat(
        n,
        n_active=n // 500,
        n_system_prompts=4,
        system_prompt_blocks=32,
        blocks_per_turn=4,
        turns_per_conversation=16,
        alpha=0.8,
        seed=3,
    ),
}
"""The named traces, each ``n`` requests long."""


def oracle_traces(directory: Path, length: int) -> dict[str, tuple[Trace, Path]]:
    """Each named trace, ``length`` requests long, and its oracleGeneral file in ``directory``."""
    return {
        name: (trace, write_oracle_general(trace, directory / f"{name}.oracleGeneral.bin"))
        for name, trace in ((name, generate(length)) for name, generate in TRACES.items())
    }
