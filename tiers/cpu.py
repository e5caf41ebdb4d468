"""The pinned-CPU swap space: fixed block slots in one page-locked allocation.

Pinned (page-locked) memory lets the GPU copy engines DMA straight into it; with
no CUDA present it is ordinary memory, paged in when the tier is built
(``page_in``), as pinned memory is: otherwise the first write into each slot
pays its page faults (stores of 80 MiB blocks into fresh slots ran at 0.1-0.3x
a memcpy on the 2-core host, 1.0x once the slots had been written). Memory the
caller provides is left as it is. Slots hold a block's serialized bytes in the
pool's order (see ``tiercache.blocks.layout``), so a remote read lands directly in a
slot and a slot is handed to a remote write without another copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercache.blocks.layout import KVLayout, PageLayout
from tiercache.bookkeeping.slots import SlotTable
from tiercache.policies import EvictionPolicy


@dataclass(frozen=True)
class CpuOptions:
    """``pin_memory``: null = pin when CUDA is available; true/false to force."""

    pin_memory: bool | None = None


class CpuTier:
    """One ``[slots, bytes_per_block]`` uint8 buffer plus its SlotTable."""

    Options = CpuOptions

    def __init__(
        self, name: str, layout: KVLayout | PageLayout, num_slots: int, policy: EvictionPolicy, options: CpuOptions,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """``buffer``: memory the caller provides (``[num_slots, bytes_per_block]`` uint8 on the CPU, e.g. shared
        with another process); by default the tier allocates its own."""
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        shape = (num_slots, layout.bytes_per_block)
        if buffer is None:
            pin = torch.cuda.is_available() if options.pin_memory is None else options.pin_memory
            buffer = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
            if not pin:
                page_in(buffer)
        elif buffer.dtype != torch.uint8 or tuple(buffer.shape) != shape or buffer.device.type != "cpu":
            raise ValueError(f"a CPU tier's buffer must be a uint8 CPU tensor of shape {shape}, got "
                             f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")
        self.buffer = buffer
        self.pinned = buffer.is_pinned()
        self._array = self.buffer.numpy()
        self.table = SlotTable(num_slots, policy)

    def view(self, slot: int) -> memoryview:
        """A writable byte view of one slot (for remote reads and writes)."""
        return memoryview(self._array[slot]).cast("B")

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.bytes_per_block


def page_in(tensor: torch.Tensor) -> None:
    """Fault every page of a fresh host tensor in now (zeroing it), so that no later copy into it pays for them."""
    tensor.zero_()
