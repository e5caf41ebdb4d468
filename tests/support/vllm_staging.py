"""``StagedTransfers`` on CPU tensors: runtimes that record or refuse copies, vLLM-shaped KV caches and regions, and
a step's stores and loads, for the staging tests (``tests/engines/vllm``).

``HostRuntime`` answers the CUDA runtime's calls on host memory at the same
addresses; the regions are real ``SharedRegion`` files; the KV caches are vLLM's
token-major layout (LBNHC) with random bytes, compared byte for byte against the
page in vLLM's logical order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiercache.integrations.vllm.connector.cudart import INVALID_VALUE, HostRuntime, MemcpyKind
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.pages import KVPages, page_views
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.staged import StagedTransfers
from tiercache.integrations.vllm.connector.transfers import GroupCopy

BLOCKS, TOKENS = 16, 16
SMALL = {"heads": 2, "content": 64}
"""A page of 2 KiB (2 heads x 16 tokens x 64 bytes)."""
LARGE = {"heads": 2, "content": 32768}
"""A page of 1 MiB: three layers' shares leave 3 MiB of a TP-2 slot to the other rank (vLLM's bound)."""


@dataclass
class Recording(HostRuntime):
    """``HostRuntime`` that keeps each copy's (kind, width, height, destination pitch, source pitch; None for a 1-D
    copy) and the stream it was queued on; a batch as one entry of ``batches``: (kind, each piece's size)."""

    copies: list[tuple[MemcpyKind, int, int, int | None, int | None]] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)
    batches: list[tuple[MemcpyKind, tuple[int, ...]]] = field(default_factory=list)

    def memcpy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: MemcpyKind,
                     stream: int) -> int:
        self.batches.append((kind, tuple(sizes)))
        self.streams.append(stream)
        for dst, src, size in zip(dsts, srcs, sizes, strict=True):  # one call: none of them recorded as a copy
            code = HostRuntime.memcpy(self, dst, src, size, kind, stream)
            if code:
                return code
        return 0

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  kind: MemcpyKind, stream: int) -> int:
        self.copies.append((kind, width, height, dst_pitch, src_pitch))
        self.streams.append(stream)
        return super().memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, kind, stream)

    def memcpy(self, dst: int, src: int, count: int, kind: MemcpyKind, stream: int) -> int:
        self.copies.append((kind, count, 1, None, None))
        self.streams.append(stream)
        return super().memcpy(dst, src, count, kind, stream)


@dataclass
class Refusing(HostRuntime):
    """A runtime whose copies of one direction fail as CUDA fails them (a pitch below the width; a 1-D copy: an
    invalid value)."""

    refuse: MemcpyKind = MemcpyKind.DEVICE_TO_HOST

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  kind: MemcpyKind, stream: int) -> int:
        if kind is self.refuse:
            dst_pitch = width - 1
        return super().memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, kind, stream)

    def memcpy(self, dst: int, src: int, count: int, kind: MemcpyKind, stream: int) -> int:
        if kind is self.refuse:
            return self._fail(INVALID_VALUE)
        return super().memcpy(dst, src, count, kind, stream)


class Late(StagedTransfers):
    """Copies that stay in flight until ``landed`` (a side stream still copying)."""

    landed = False

    def _ended(self, flight: object) -> bool:
        return self.landed


def kv_cache(layers: list[str], heads: int, content: int, seed: int) -> dict[str, torch.Tensor]:
    """One allocation viewed per layer as ``[blocks, heads, tokens, content]`` bytes, token-major (LBNHC)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (len(layers), BLOCKS, TOKENS, heads, content), dtype=torch.uint8,
                        generator=generator)
    return {name: raw[index].permute(0, 2, 1, 3) for index, name in enumerate(layers)}


def one_group(layers: int, world: int = 1, page: int = 2 * TOKENS * 64) -> SlotGeometry:
    names = tuple(f"model.layers.{index}.self_attn.attn" for index in range(layers))
    return SlotGeometry((GroupGeometry(GroupKind.FULL, names, page),), world, TOKENS)


def hybrid() -> SlotGeometry:
    """Two groups: two full-attention layers, one sliding-window layer."""
    page = 2 * TOKENS * 64
    return SlotGeometry((GroupGeometry(GroupKind.FULL, ("model.layers.0.attn", "model.layers.1.attn"), page),
                         GroupGeometry(GroupKind.SLIDING, ("model.layers.2.attn",), page, window_blocks=3)), 1,
                        TOKENS)


def region(tmp_path: Path, geometry: SlotGeometry, slots: int = 24, rank: int = 0) -> SharedRegion:
    return SharedRegion.for_worker(tmp_path / "tiercache-staging-dp0", slots, geometry.slot_bytes, rank)


def engine(geometry: SlotGeometry, kv: dict[str, torch.Tensor], shared: SharedRegion, rank: int = 0,
           kind: type[StagedTransfers] = StagedTransfers, **options: object) -> StagedTransfers:
    pages = KVPages(page_views(kv, geometry), geometry, rank, shared.slots)
    return kind(pages, geometry, rank, shared.slots, **options)


def store(copies: StagedTransfers, jobs: list[GroupCopy]) -> list[int]:
    """One step storing ``jobs`` (every layer, then the step's end); the ids ``store_layer`` failed."""
    failed: set[int] = set()
    for index, layer in enumerate(copies.pages.layers):
        failed.update(copies.store_layer(index, [job for job in jobs if job.group == layer.group
                                                 and job.job_id not in failed]))
    copies.end_step([], list(dict.fromkeys(job.job_id for job in jobs)))
    return sorted(failed)


def load(copies: StagedTransfers, jobs: list[GroupCopy]) -> list[int]:
    failed = copies.load(jobs)
    copies.end_step(list(dict.fromkeys(job.job_id for job in jobs)), [])
    return failed


def page(kv: dict[str, torch.Tensor], name: str, block: int) -> bytes:
    """A block's page of layer ``name`` in vLLM's logical order."""
    return bytes(kv[name][block].contiguous().flatten().numpy())


def slot_pages(shared: SharedRegion, geometry: SlotGeometry, rank: int, group: int, slot: int) -> list[bytes]:
    spec = geometry.groups[group]
    start = geometry.offset(rank, group, 0)
    return [bytes(shared.slots[slot, start + i * spec.page_bytes : start + (i + 1) * spec.page_bytes].numpy())
            for i in range(len(spec.layer_names))]


def stored_right(shared: SharedRegion, geometry: SlotGeometry, kv: dict[str, torch.Tensor], job: GroupCopy,
                 rank: int = 0) -> bool:
    names = geometry.groups[job.group].layer_names
    return all(slot_pages(shared, geometry, rank, job.group, slot) == [page(kv, name, block) for name in names]
               for slot, block in zip(job.slots, job.blocks, strict=True))
