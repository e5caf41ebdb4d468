"""The int8 level on an engine's pages: groups of ``group_elements`` contiguous elements (vLLM's head size), one
float16 scale a group. Real K/V (SmolLM2 on ShareGPT) laid out as vLLM's CPU backend keeps it, in every engine
dtype, as a TP rank's share and as a hybrid model's smaller group; round trips within the stated bound (a bound,
never equality), a damaged value is a miss that leaves the slot alone, an exact reader never loads int8 values, and
``compact`` stays refused for pages."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from support.coded_tiers import view, write_and_read
from support.lossy_pages import cpu_page, within_int8_bound

from tiercache.blocks.codec import Codec
from tiercache.blocks.layout import PageLayout
from tiercache.blocks.namespaces import PageFormat
from tiercache.blocks.value_format import HEADER_SIZE, CodedPayload, DecodeStatus
from tiercache.codecs.coding import INTEGRITY_BYTES, KVCoding
from tiercache.codecs.geometry import KVGeometry, UnsupportedPages
from tiercache.codecs.levels import Level
from tiercache.common.fields import FieldError
from tiercache.config import ConfigError, config_from_dict
from tiercache.remote.build import build_tier, model_namespace
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteTier
from tiercache.tiers.coded import CodedTier

HEAD = 64
"""SmolLM2's head size: elements per group."""
BLOCK = 32
"""Tokens per vLLM block on the CPU build (a multiple of 32)."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def slot_of(sample: torch.Tensor, dtype: torch.dtype, layers: slice = slice(None), heads: slice = slice(None),
            start: int = 0) -> torch.Tensor:
    """One block of ``sample`` (``[layers, 2, tokens, channels]``) as a slot of CPU-backend pages, a layer each."""
    part = sample[layers, :, start : start + BLOCK].unflatten(-1, (-1, HEAD))[..., heads, :]
    return torch.stack([cpu_page(layer[0], layer[1]) for layer in part]).to(dtype)


def page_coding(slot: torch.Tensor) -> KVCoding:
    layout = PageLayout(slot.numel() * slot.element_size(), BLOCK, PageFormat("vllm-connector", {}),
                        str(slot.dtype).removeprefix("torch."), HEAD)
    return KVCoding(KVGeometry.of(layout), [Level.INT8])


def round_trip(slot: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``slot`` through the int8 level: the decoded slot and the payload's bytes."""
    coding = page_coding(slot)
    payload = coding.encode(Level.INT8, view(slot))
    out = torch.empty_like(slot)
    assert coding.decode_into(payload.coding, memoryview(payload.data), view(out))
    return out, len(payload.data)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_int8_round_trips_vllm_cpu_pages_within_its_bound(real_kv: list[torch.Tensor], dtype: str) -> None:
    for sample in real_kv:
        for start in range(0, sample.shape[2] - BLOCK + 1, BLOCK):
            slot = slot_of(sample, DTYPES[dtype], start=start)
            decoded, size = round_trip(slot)
            assert within_int8_bound(slot, decoded, HEAD), dtype
            assert not torch.equal(decoded, slot), "a lossy level that changed nothing"
            assert size == INTEGRITY_BYTES + slot.numel() // HEAD * (2 + HEAD)  # a float16 scale, 64 integers a group
    ratio = slot.numel() * slot.element_size() / size
    assert ratio > {"float32": 3.8, "float16": 1.9, "bfloat16": 1.9}[dtype]


def test_a_tp_ranks_pages_and_a_hybrid_models_smaller_group_round_trip(real_kv: list[torch.Tensor]) -> None:
    sample = real_kv[1]
    ranks = torch.cat([slot_of(sample, torch.bfloat16, heads=slice(rank, rank + 1)).flatten() for rank in range(3)])
    decoded, _ = round_trip(ranks)  # a slot holds every rank's share: [rank][layer][page of its one head]
    assert within_int8_bound(ranks, decoded, HEAD)
    full = slot_of(sample, torch.float16, layers=slice(0, 20)).flatten()
    sliding = slot_of(sample, torch.float16, layers=slice(20, 30)).flatten()
    slot = full.clone()  # the slot last held a block of the larger group; the smaller group's tail is left over
    slot[: sliding.numel()] = sliding
    decoded, _ = round_trip(slot)
    assert within_int8_bound(slot, decoded, HEAD)


def test_a_damaged_int8_page_value_is_a_miss_that_leaves_the_slot_alone(real_kv: list[torch.Tensor]) -> None:
    slot = slot_of(real_kv[0], torch.bfloat16)
    coding = page_coding(slot)
    codec = Codec(bytes(16), coding=coding)
    key = b"k" * 16
    good = coding.encode(Level.INT8, view(slot))
    target = torch.full_like(slot, 7)
    cut = CodedPayload(good.coding, good.data[: len(good.data) // 2], good.raw_length)  # checksummed, but cut
    decoded = codec.decode_into(key, codec.encode_value(key, cut), view(target))
    assert decoded.status is DecodeStatus.BAD_CODING and decoded.status.damaged
    flipped = bytearray(codec.encode_value(key, good))
    flipped[HEADER_SIZE + 5] ^= 0x40  # a scale's bits
    decoded = codec.decode_into(key, bytes(flipped), view(target))
    assert decoded.status is DecodeStatus.BAD_CHECKSUM and (target == 7).all()


def test_page_layouts_say_their_elements_together_and_the_format_names_them() -> None:
    opaque = PageLayout(4096, 16, PageFormat("eng", {"a": 1}))
    grouped = PageLayout(4096, 16, PageFormat("eng", {"a": 1}), "bfloat16", 64)
    assert grouped.page_format() == PageFormat("eng", {"a": 1, "element_dtype": "bfloat16", "group_elements": 64})
    prints = {layout.page_format().fingerprint() for layout in (
        opaque, grouped, PageLayout(4096, 16, PageFormat("eng", {"a": 1}), "bfloat16", 128),
        PageLayout(4096, 16, PageFormat("eng", {"a": 1}), "float16", 64))}
    assert len(prints) == 4, "fleets that group or type their elements differently never share values"
    for fields, name in (({"element_dtype": "bfloat16"}, "group_elements"), ({"group_elements": 64}, "group_elements"),
                         ({"element_dtype": "uint8", "group_elements": 64}, "element_dtype"),
                         ({"element_dtype": "float32", "group_elements": 48}, "group_elements")):
        with pytest.raises(FieldError, match=name):
            PageLayout(4096, 16, **fields)
    with pytest.raises(UnsupportedPages, match="element dtype and group size"):
        KVGeometry.of(opaque)
    pages = KVGeometry.of(grouped)
    assert pages.unreadable(Level.COMPACT) and pages.unreadable(Level.INT8) is None
    with pytest.raises(UnsupportedPages, match="compact"):
        KVCoding(pages, [Level.INT8, Level.COMPACT])


def page_tier(url: str, codec: dict[str, Any] | None, slot: torch.Tensor, source: str = "t.yaml") -> RemoteTier:
    """A Redis tier below an engine's pool whose layout (YAML) names ``slot``'s pages' elements."""
    layout = {"block_bytes": slot.numel() * slot.element_size(), "block_size": BLOCK,
              "element_dtype": str(slot.dtype).removeprefix("torch."), "group_elements": HEAD}
    redis: dict[str, Any] = {"name": "redis", "type": "redis", "options": {"url": url}}
    if codec is not None:
        redis["codec"] = codec
    config = config_from_dict({"model": {"id": "pages"}, "layout": layout,
                               "tiers": [{"type": "cpu", "capacity_blocks": 4}, redis]}, source, engine_pool=True)
    return build_tier(config.tiers[1], model_namespace(config)[1], config.layout.bytes_per_block, config.layout)


def test_compact_is_declined_for_pages_with_a_reason_and_int8_kept(
    real_kv: list[torch.Tensor], tables_file: Any, caplog: pytest.LogCaptureFixture
) -> None:
    slot = slot_of(real_kv[0], torch.float16)
    with caplog.at_level(logging.WARNING, logger="tiercache.remote.build"):
        both = page_tier("redis://127.0.0.1:1", {"levels": ["compact", "int8"], "adaptive": True,
                                                 "tables": str(tables_file)}, slot)
        alone = page_tier("redis://127.0.0.1:1", {"levels": ["compact"], "tables": str(tables_file)}, slot)
    assert isinstance(both, CodedTier) and both.config.levels == [Level.INT8] and both.config.adaptive
    assert not isinstance(alone, CodedTier) and alone.codec.coding is None
    assert "codec level compact declined: the compact level needs tokens x channels per layer" in caplog.text
    assert "no lossy codec level left, storing exact KV" in caplog.text
    with pytest.raises(ConfigError, match=r"t\.yaml: layout\.group_elements"):
        page_tier("redis://127.0.0.1:1", None, slot.flatten()[:-1])  # not a whole number of groups


def test_int8_pages_over_redis_load_for_an_int8_reader_and_never_for_an_exact_one(
    redis_server: RedisServer, real_kv: list[torch.Tensor]
) -> None:
    slots = [slot_of(real_kv[0], torch.bfloat16, start=start) for start in (0, BLOCK)]
    int8 = {"levels": ["int8"]}
    exact = page_tier(redis_server.url, None, slots[0])
    assert asyncio.run(write_and_read(page_tier(redis_server.url, int8, slots[0]), exact, slots)) == [None, None]
    reader = page_tier(redis_server.url, int8, slots[0])
    decoded = asyncio.run(write_and_read(page_tier(redis_server.url, int8, slots[0]), reader, slots))
    assert all(out is not None and within_int8_bound(slot, out, HEAD) for out, slot in zip(decoded, slots,
                                                                                            strict=True))
    assert isinstance(reader, CodedTier) and reader.stats()["level_int8_blocks"] == len(slots)
