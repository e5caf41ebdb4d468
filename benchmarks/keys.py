"""Tokens hashed per second by BlockHasher, next to the bare BLAKE2b chain and a memcpy ceiling.

Target: >= 10 M tokens/s on the 2-core development machine.

    python benchmarks/keys.py [--quick] [--out PATH]
"""

from __future__ import annotations

import hashlib

import numpy as np
from common import arguments, best_seconds, parse, write_result

from tiercache.blocks.keys import BlockHasher, Namespace

TOKENS = 1 << 20
REPEATS = 5
BLOCK_SIZES = (16, 32, 64)
TARGET_TOKENS_PER_SECOND = 10e6
QUICK = {"TOKENS": 1 << 12, "REPEATS": 1}
"""The constants ``--quick`` replaces."""


def bare_chain(tokens: np.ndarray, block_size: int) -> None:
    """The same chain with nothing around it: the ceiling for a Python-level hasher."""
    data = memoryview(tokens.tobytes())
    stride = block_size * 8
    previous = bytes(16)
    for start in range(0, len(data), stride):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(data[start : start + stride])
        previous = digest.digest()


def main() -> None:
    args = parse(arguments(__doc__.splitlines()[0]))
    if args.quick:
        globals().update(QUICK)
    tokens = np.random.default_rng(0).integers(0, 150_000, TOKENS, dtype=np.int64)
    as_list = tokens.tolist()
    rows = []
    for block_size in BLOCK_SIZES:
        hasher = BlockHasher(Namespace("bench", "layout"), block_size)
        array_rate = TOKENS / best_seconds(lambda h=hasher: h.keys(tokens), REPEATS)
        list_rate = TOKENS / best_seconds(lambda h=hasher: h.keys(as_list), REPEATS)
        bare_rate = TOKENS / best_seconds(lambda b=block_size: bare_chain(tokens, b), REPEATS)
        rows.append(
            {
                "block_size": block_size,
                "numpy_tokens_per_s": array_rate,
                "list_tokens_per_s": list_rate,
                "bare_chain_tokens_per_s": bare_rate,
                "ratio_to_bare_chain": array_rate / bare_rate,
                "meets_target": min(array_rate, list_rate) >= TARGET_TOKENS_PER_SECOND,
            }
        )
    print(f"{'block':>6}{'numpy M tok/s':>15}{'list M tok/s':>14}{'bare chain':>12}{'ratio':>7}{'>=10M':>7}")
    for row in rows:
        print(
            f"{row['block_size']:>6}{row['numpy_tokens_per_s'] / 1e6:>15.1f}{row['list_tokens_per_s'] / 1e6:>14.1f}"
            f"{row['bare_chain_tokens_per_s'] / 1e6:>12.1f}{row['ratio_to_bare_chain']:>7.2f}"
            f"{'yes' if row['meets_target'] else 'NO':>7}"
        )
    print(f"wrote {write_result(__file__, {'tokens': TOKENS, 'rows': rows}, args.out, args.quick)}")


if __name__ == "__main__":
    main()
