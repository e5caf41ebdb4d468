"""The local tiers' bookkeeping: pure, no threads, no I/O, no bytes; tested step by step.

``slots`` (``SlotTable``: one tier's slots, keys and ref counts under the protocol of
docs/architecture.md, "Entry state", its policy choosing victims; ``free_slots``, its free
list; ``slot_checksums``, its slots' checksums), ``memory_tiers`` (the GPU pool and CPU
tier read and pinned together; a lookup's pins; the engine's holds),
``hierarchy`` (the GPU pool and the CPU tier filling each other: write policy,
admission, ``exclusive``, demotions and promotions turned into moves, an
operator's reset of the CPU tier), ``remote_writes`` (the remotes below the CPU
tier: the puts their write policies ask for, the puts in flight, what each was
told to hold), ``admission`` (write policies and hit counts), ``load_plan`` (a
load's plan and pins), ``moves`` (the moves as values, ``HostCopy`` and
``RemotePut``, and the ``Outbox`` they wait in for the mover) and
``written_keys`` (the keys each remote holds, with when each was last seen).

Imports from: ``common``, ``policies``, ``blocks``, ``telemetry``.
"""
