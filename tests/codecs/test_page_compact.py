"""The compact level on an engine's pages read through a token map: real K/V (SmolLM2 on ShareGPT) laid out as
FlashAttention's pages (each token's K then V) and as vLLM's CPU kernel's (K transposed), in every engine dtype and
as TP ranks' shares, round-trips within the stated bound (a bound, never equality); a map that does not fit is
refused; over Redis a compact reader loads the values and an exact one never does."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.coded_tiers import view, write_and_read
from support.lossy_pages import compact_bound, cpu_page

from tiercache.blocks.layout import PageLayout
from tiercache.blocks.namespaces import PageFormat
from tiercache.blocks.token_map import PageTokenMap, interleaved_map
from tiercache.codecs.coding import KVCoding
from tiercache.codecs.geometry import KVGeometry
from tiercache.codecs.levels import Level
from tiercache.codecs.tables import CompactTables, learn_tables
from tiercache.common.fields import FieldError
from tiercache.config import config_from_dict
from tiercache.remote.build import build_tier, model_namespace
from tiercache.testing.redis_servers import RedisServer
from tiercache.tiers.base import RemoteTier
from tiercache.tiers.coded import CodedTier

HEAD = 64
BLOCK = 32
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def flash_page(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One layer's page as FlashAttention's logical page: ``[heads, tokens, 2 * head_size]``, a token's K then V."""
    return torch.cat([k.transpose(0, 1), v.transpose(0, 1)], dim=-1)


def cpu_map(layers: int, ranks: int, heads: int) -> PageTokenMap:
    """The CPU ``vec`` kernel's order, written out here: a head's K as ``[head_size, tokens]``, then V row-major."""
    key = tuple(d * BLOCK + t for t in range(BLOCK) for d in range(HEAD))
    value = tuple(BLOCK * HEAD + t * HEAD + d for t in range(BLOCK) for d in range(HEAD))
    return PageTokenMap(layers, ranks, heads, HEAD, BLOCK, key, value, "test: vec")


LAYOUTS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[int, int, int], PageTokenMap]]] = {
    "flash": (flash_page, lambda layers, ranks, heads: interleaved_map(layers, ranks, heads, HEAD, BLOCK, "test")),
    "cpu": (cpu_page, cpu_map),
}


def slot_of(logical: torch.Tensor, page: Callable[..., torch.Tensor], ranks: int) -> torch.Tensor:
    """A block's ``[layers, 2, tokens, channels]`` values as a slot: ``[rank][layer][page]``, each rank its heads."""
    per_rank = logical.unflatten(-1, (ranks, -1, HEAD))  # [layers, 2, tokens, ranks, heads, head]
    return torch.stack([torch.stack([page(layer[0][:, rank], layer[1][:, rank]) for layer in per_rank])
                        for rank in range(ranks)])


def coding_for(slot: torch.Tensor, token_map: PageTokenMap, tables: CompactTables) -> KVCoding:
    layout = PageLayout(slot.numel() * slot.element_size(), BLOCK, PageFormat("vllm-connector", {}),
                        str(slot.dtype).removeprefix("torch."), HEAD, token_map)
    return KVCoding(KVGeometry.of(layout), [Level.COMPACT, Level.INT8], tables)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_compact_round_trips_pages_through_their_token_map_within_its_bound(
    real_kv: list[torch.Tensor], tables: CompactTables, kind: str, dtype: str
) -> None:
    page, make_map = LAYOUTS[kind]
    for sample in real_kv:
        layers, _, _, channels = sample.shape
        logical = sample[:, :, :BLOCK].to(DTYPES[dtype]).float()
        slot = slot_of(logical, page, 1).to(DTYPES[dtype])
        coding = coding_for(slot, make_map(layers, 1, channels // HEAD), tables)
        payload = coding.encode(Level.COMPACT, view(slot))
        out = torch.full_like(slot, float("nan"))
        assert coding.decode_into(payload.coding, memoryview(payload.data), view(out))
        bound = slot_of(compact_bound(logical, tables, dtype), page, 1)
        assert ((out.float() - slot.float()).abs() <= bound).all(), (kind, dtype)
        assert not torch.equal(out, slot), "a lossy level that changed nothing"
        int8 = coding.encode(Level.INT8, view(slot))
        assert len(payload.data) < len(int8.data) < slot.numel() * slot.element_size()


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_two_tp_ranks_shares_of_the_heads_round_trip_with_tables_of_their_heads(
    learned_kv: list[torch.Tensor], real_kv: list[torch.Tensor], kind: str
) -> None:
    page, make_map = LAYOUTS[kind]
    heads = slice(0, 2 * HEAD)  # two heads, one a rank
    tables = learn_tables([sample[..., heads] for sample in learned_kv])
    logical = real_kv[0][:, :, BLOCK : 2 * BLOCK, heads].to(torch.bfloat16).float()
    slot = slot_of(logical, page, 2).to(torch.bfloat16)
    coding = coding_for(slot, make_map(logical.shape[0], 2, 1), tables)
    payload = coding.encode(Level.COMPACT, view(slot))
    out = torch.zeros_like(slot)
    assert coding.decode_into(payload.coding, memoryview(payload.data), view(out))
    assert ((out.float() - slot.float()).abs() <= slot_of(compact_bound(logical, tables, "bfloat16"), page, 2)).all()
    swapped = slot_of(logical.unflatten(-1, (2, -1)).flip(-2).flatten(-2), page, 2)  # rank 1's heads as rank 0's
    assert not ((out.float() - swapped).abs() <= slot_of(compact_bound(logical, tables, "bfloat16"), page, 2)).all()


def test_a_token_map_that_does_not_fit_its_pages_is_refused() -> None:
    fitting = interleaved_map(2, 1, 3, HEAD, BLOCK)
    with pytest.raises(FieldError, match="key"):
        PageTokenMap(2, 1, 3, HEAD, BLOCK, fitting.key, fitting.key)  # V on K's elements
    with pytest.raises(FieldError, match="key"):
        PageTokenMap(2, 1, 3, HEAD, BLOCK, fitting.key[:-1], fitting.value)
    block_bytes = fitting.elements * 2
    for other in ({"element_dtype": "float32", "group_elements": HEAD},  # 4-byte elements overflow the block
                  {"element_dtype": "float16", "group_elements": HEAD, "block_size": 16}):
        with pytest.raises(FieldError, match="token_map"):
            PageLayout(**{"block_bytes": block_bytes, "block_size": BLOCK, **other, "token_map": fitting})
    with pytest.raises(FieldError, match="token_map"):
        PageLayout(block_bytes, BLOCK, token_map=fitting)  # no element dtype: no values to map
    geometry = KVGeometry.of(PageLayout(block_bytes, BLOCK, None, "float16", HEAD, fitting))
    assert geometry.unreadable(Level.COMPACT) is None and (geometry.layers, geometry.channels) == (2, 3 * HEAD)
    assert geometry.group_size == HEAD and geometry.groups == 2 * 3 * 2 * BLOCK


def page_tier(url: str, codec: dict[str, Any] | None, slot: torch.Tensor, token_map: PageTokenMap) -> RemoteTier:
    """A Redis tier below an engine's pool whose pages carry ``token_map`` (as vLLM's connector gives it)."""
    redis: dict[str, Any] = {"name": "redis", "type": "redis", "options": {"url": url}}
    if codec is not None:
        redis["codec"] = codec
    config = config_from_dict({"model": {"id": "pages"}, "layout": {
        "block_bytes": slot.numel() * slot.element_size(), "block_size": BLOCK,
        "element_dtype": str(slot.dtype).removeprefix("torch."), "group_elements": HEAD},
        "tiers": [{"type": "cpu", "capacity_blocks": 4}, redis]}, "t.yaml", engine_pool=True)
    config.layout = dataclasses.replace(config.layout, token_map=token_map)
    return build_tier(config.tiers[1], model_namespace(config)[1], config.layout.bytes_per_block, config.layout)


def test_compact_pages_over_redis_load_for_a_compact_reader_and_never_for_an_exact_one(
    redis_server: RedisServer, real_kv: list[torch.Tensor], tables: CompactTables, tables_file: Any
) -> None:
    sample = real_kv[0]
    token_map = cpu_map(sample.shape[0], 1, sample.shape[-1] // HEAD)
    logical = [sample[:, :, start : start + BLOCK].to(torch.float16).float() for start in (0, BLOCK)]
    slots = [slot_of(values, cpu_page, 1).to(torch.float16) for values in logical]
    compact = {"levels": ["compact"], "tables": str(tables_file)}
    exact = page_tier(redis_server.url, None, slots[0], token_map)
    assert asyncio.run(write_and_read(page_tier(redis_server.url, compact, slots[0], token_map), exact,
                                      slots)) == [None, None]
    reader = page_tier(redis_server.url, compact, slots[0], token_map)
    assert isinstance(reader, CodedTier) and reader.config.levels == [Level.COMPACT]
    decoded = asyncio.run(write_and_read(page_tier(redis_server.url, compact, slots[0], token_map), reader, slots))
    for out, slot, values in zip(decoded, slots, logical, strict=True):
        assert out is not None
        assert ((out.float() - slot.float()).abs() <= slot_of(compact_bound(values, tables, "float16"), cpu_page,
                                                              1)).all()
    assert reader.stats()["level_compact_blocks"] == len(slots)
