"""The garbage collector as vLLM's engine core leaves it: the heap frozen once start-up is done."""

from __future__ import annotations

import gc


def frozen_heap() -> None:
    """Collect, then freeze what is alive (vLLM's ``freeze_gc_heap``): later collections scan only what comes after.
    ``gc.unfreeze()`` undoes it."""
    gc.collect()
    gc.freeze()
