"""An operator's reset of the CPU tier (vLLM's ``reset_cache``): every entry nothing holds leaves it.

Pure: no threads, no I/O. An entry stays, readable in its slot, while anything holds it: a pin (a
lookup's, a fetch's, a put to a remote in flight), a write into it (the engine's copy, a remote read,
an exploration), or a remote lane that still needs it written (``Hierarchy.owes``: a put that failed or
was dropped, a ``write_back`` lane not filled yet), since dropping it then would need a write-back that
a full store queue drops. Each entry dropped is counted and reported as an eviction is; the remotes,
the hit counts and what each remote was told to hold are left as they are.
"""

from __future__ import annotations

from tiercache.bookkeeping.hierarchy import Hierarchy


def reset_cpu_tier(hierarchy: Hierarchy) -> list[bytes]:
    """Drop the CPU tier's entries nothing holds, freeing their slots; the keys dropped, in slot order."""
    cpu = hierarchy.local.cpu
    assert cpu is not None, "a CPU tier's reset needs a CPU tier"
    lanes = range(len(hierarchy.lanes))
    dropped = []
    for slot in range(cpu.num_slots):
        key = cpu.key_of(slot)
        if key is None or cpu.ref(slot) != 0 or any(hierarchy.owes(lane, key) for lane in lanes):
            continue
        cpu.discard(key)
        dropped.append(key)
    hierarchy.metrics.add(hierarchy.cpu_name, "evictions", len(dropped))
    if dropped:
        hierarchy.observer.removed(hierarchy.cpu_name, dropped)
    return dropped
