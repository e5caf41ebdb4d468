"""What a model's identity costs at start-up: the sampled weights digest next to reading the whole checkpoint.

Every adapter takes ``ModelIdentity`` once per process (docs/architecture.md, "Which model's KV"). This
writes a safetensors checkpoint of ``CHECKPOINT_BYTES`` in ``TENSORS`` tensors (a 24-layer model's count),
then times ``checkpoint_digest`` from a cold page cache (a full run only, where this process may drop the
cache: root on Linux), warm, and memoized (the second call of a process), and the in-memory digest
``transformers`` takes; the ceiling is one full read of the file with XXH3 over every byte, warm, as a
full digest would cost.

Target: a warm digest <= 10% of one full read at 1 GB (the ratio column; the gap widens with size: the
digest reads per tensor, the full read per byte), a memoized one under 1 ms.

    python benchmarks/model_identity.py [--quick] [--out PATH]
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from common import arguments, best_seconds, parse, write_result
from safetensors.torch import save_file

from tiercache.blocks import model_identity
from tiercache.blocks.model_identity import checkpoint_digest, tensors_digest

CHECKPOINT_BYTES = 1 << 30
TENSORS = 219
REPEATS = 3
READ_CHUNK = 16 << 20
TARGET_RATIO = 0.1
QUICK = {"CHECKPOINT_BYTES": 8 << 20, "TENSORS": 20, "REPEATS": 1}
"""The constants ``--quick`` replaces."""


def checkpoint_tensors() -> dict[str, torch.Tensor]:
    """``TENSORS`` float32 tensors of about ``CHECKPOINT_BYTES`` in all (random: no two windows alike)."""
    elements = CHECKPOINT_BYTES // 4 // TENSORS
    generator = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.weight": torch.randn(elements, generator=generator) for i in range(TENSORS)}


def drop_page_cache() -> bool:
    """Whether the kernel's page cache could be dropped (needs root), so the next read comes from the disk."""
    done = subprocess.run(["sh", "-c", "sync && echo 3 > /proc/sys/vm/drop_caches"], capture_output=True, check=False)
    return done.returncode == 0


def fresh_digest(directory: Path) -> str:
    """The digest as a new process takes it (the per-process cache emptied first)."""
    model_identity._checkpoint_digest.cache_clear()
    return checkpoint_digest(directory)


def full_read(path: Path) -> str:
    """XXH3 of every byte of the file: what digesting the whole checkpoint costs."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    args = parse(arguments(__doc__.splitlines()[0]))
    if args.quick:
        globals().update(QUICK)
    tensors = checkpoint_tensors()
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        save_file(tensors, directory / "model.safetensors")
        size = (directory / "model.safetensors").stat().st_size
        cold = None
        if not args.quick and drop_page_cache():  # a quick run leaves the machine's page cache alone
            started = time.perf_counter()
            fresh_digest(directory)
            cold = time.perf_counter() - started
        warm = best_seconds(lambda: fresh_digest(directory), REPEATS)
        memoized = best_seconds(lambda: checkpoint_digest(directory), REPEATS)
        ceiling = best_seconds(lambda: full_read(directory / "model.safetensors"), REPEATS)
    in_memory = best_seconds(lambda: tensors_digest(tensors.items()), REPEATS)
    row = {
        "checkpoint_bytes": size, "tensors": TENSORS, "cold_s": cold, "warm_s": warm, "memoized_s": memoized,
        "in_memory_s": in_memory, "full_read_s": ceiling, "ratio_to_full_read": warm / ceiling,
        "meets_target": warm / ceiling <= TARGET_RATIO and memoized < 1e-3,
    }
    print(f"{'GB':>6}{'tensors':>9}{'cold ms':>9}{'warm ms':>9}{'memo ms':>9}{'in-mem ms':>11}{'full read ms':>14}"
          f"{'ratio':>7}{'target':>8}")
    print(f"{size / 1e9:>6.2f}{TENSORS:>9}{(cold or float('nan')) * 1e3:>9.1f}{warm * 1e3:>9.1f}"
          f"{memoized * 1e3:>9.2f}{in_memory * 1e3:>11.1f}{ceiling * 1e3:>14.1f}{row['ratio_to_full_read']:>7.3f}"
          f"{'yes' if row['meets_target'] else 'NO':>8}")
    result = {"rows": [row], "cold_cache_dropped": cold is not None}
    print(f"wrote {write_result(__file__, result, args.out, args.quick)}")


if __name__ == "__main__":
    main()
