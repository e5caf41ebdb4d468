"""Blocks through a remote tier and back: one writer's ``put`` then one reader's ``get_into``, on started tiers.

The codecs' tests write blocks (K/V of a layout, or an engine's pages) with one
tier and read them with another over the same store, to see what each reader
loads: ``write_and_read`` answers, per block, the slot it decoded into or None
for a miss.
"""

from __future__ import annotations

import torch

from tiercache.tiers.base import RemoteTier


def view(block: torch.Tensor) -> memoryview:
    return memoryview(block.view(torch.uint8).numpy()).cast("B")


async def write_and_read(
    writer: RemoteTier, reader: RemoteTier, blocks: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """``blocks`` put by ``writer`` under keys of their own, then read by ``reader`` into zeroed slots."""
    keys = [bytes([i]) * 16 for i in range(len(blocks))]
    await writer.start()
    await reader.start()
    try:
        assert all(await writer.put(keys, [view(block) for block in blocks]))
        slots = [torch.zeros_like(block) for block in blocks]
        oks = await reader.get_into(keys, [view(slot) for slot in slots])
        await reader.settle()
        return [slot if ok else None for slot, ok in zip(slots, oks, strict=True)]
    finally:
        await writer.close()
        await reader.close()
