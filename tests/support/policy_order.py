"""The keys a slot table's policy holds, in the policy's order (a policy orders slots, not keys)."""

from __future__ import annotations

from tiercache.bookkeeping.slots import SlotTable


def policy_keys(table: SlotTable) -> list[bytes]:
    """Each resident slot's key, bound or reserved, in the policy's order (each list oldest first)."""
    return [table.key_of(slot) or table._reserved[slot] for slot in table.policy]
