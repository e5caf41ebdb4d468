"""The local tiers' bookkeeping: pure, no threads, no I/O, no bytes; tested step by step.

``slots`` (``SlotTable``: one tier's slots, keys and ref counts under the protocol of
docs/architecture.md, "Entry state", its policy choosing victims), ``memory_tiers`` (the GPU pool
and CPU tier read and pinned together; a lookup's pins; the engine's holds),
``hierarchy`` (write policies, admission, ``exclusive``, demotions and
promotions turned into moves), ``admission`` (write policies and hit counts),
``load_plan`` (a load's plan and pins, and every slot change a load makes),
``moves`` (the moves as values: ``HostCopy``, ``RemotePut``), ``written_keys``
(what each remote was told to hold) and ``cpu_reset`` (an operator's reset of the CPU tier).

Imports from: ``common``, ``policies``, ``blocks``, ``telemetry``.
"""
