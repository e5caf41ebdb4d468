"""The GPU block pool: the engine's paged KV tensors, shared with tiercache.

The pool tensors (see ``KVLayout.pool_shapes``) live on the configured device;
``device: cpu`` stands in for a GPU so the same code paths run without one. The
attention kernels read these tensors through block tables; tiercache indexes
which block holds which key and moves blocks to and from the pinned-CPU tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tiercache.blocks.layout import KVLayout
from tiercache.bookkeeping.slots import SlotTable
from tiercache.common.fields import FieldError
from tiercache.policies import EvictionPolicy

AUTO_DEVICE = "auto"
DEVICE_TYPES = ("cpu", "cuda")
"""Device types the pool can live on (``cpu`` stands in for a GPU)."""


@dataclass(frozen=True)
class GpuOptions:
    """``device``: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""

    device: str = AUTO_DEVICE

    def __post_init__(self) -> None:
        expected = "'auto', 'cpu', 'cuda' or 'cuda:N'"
        if not isinstance(self.device, str):
            raise FieldError("device", expected, self.device)
        if self.device == AUTO_DEVICE:
            return
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise FieldError("device", expected, self.device) from None
        if device.type not in DEVICE_TYPES or (device.type == "cpu" and device.index not in (None, 0)):
            raise FieldError("device", expected, self.device)


def resolve_device(name: str) -> torch.device:
    """Turn ``auto`` into the best device present; validate the rest."""
    if name == AUTO_DEVICE:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    return device


class GpuTier:
    """The paged KV pool plus its SlotTable (block id == slot)."""

    Options = GpuOptions

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        num_blocks: int,
        policy: EvictionPolicy,
        options: GpuOptions,
        tensors: list[torch.Tensor] | None = None,
    ) -> None:
        self.name = name
        self.layout = layout
        if tensors is None:
            self.device = resolve_device(options.device)
            tensors = layout.allocate_pool(num_blocks, self.device)
        else:
            num_blocks = layout.validate_pool(tensors)
            self.device = tensors[0].device
        self.tensors = tensors
        self.num_blocks = num_blocks
        self.table = SlotTable(num_blocks, policy)

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def __len__(self) -> int:
        """Number of pool tensors: 1 block-major, or one per layer."""
        return len(self.tensors)

    def __getitem__(self, index: int) -> torch.Tensor:
        """``mgr.gpu[i]``: the i-th pool tensor (the whole pool, or layer i)."""
        return self.tensors[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.tensors)
