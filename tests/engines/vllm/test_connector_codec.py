"""The connector's ``codec``: int8 values of vLLM's pages under vLLM 0.33's own scheduler and KV cache specs.

vLLM's spec gives the pages' element dtype and head size; a remote tier with
``codec: {levels: [int8]}`` stores each group of ``head_size`` contiguous
elements as 8-bit integers under a float16 scale. The "model" here writes float
pages (``support.lossy_pages``), and every page the attention reads after a load
is checked within int8's stated bound (a bound, never equality). An instance
without a codec (an exact reader) never loads the int8 values: it recomputes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.lossy_pages import value_page, within_int8_bound
from support.vllm_connector import PROMPT, Instance, Instances, remote_written, request, tiers_of, totals
from support.vllm_groups import HEAD_SIZE as GROUP_HEAD_SIZE
from support.vllm_groups import WINDOW_BLOCKS, kv_config_of
from support.vllm_parts import BLOCK, LAYERS, NUM_BLOCKS, cpu_topology, simulated_remote, vllm_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tiercache.codecs.levels import Level
from tiercache.integrations.vllm.connector.geometry import instance_geometry
from tiercache.integrations.vllm.connector.namespace import model_identity, page_format
from tiercache.integrations.vllm.connector.options import ConnectorOptions
from tiercache.remote.build import build_tier, model_namespace
from tiercache.tiers.coded import CodedTier

HEADS, HEAD = 2, 64
"""KV heads and head size of the specs here (a group of 64 elements, as SmolLM2's)."""
INT8 = {"codec": {"levels": ["int8"]}}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
USABLE = 6
"""Full blocks of ``PROMPT`` (100 tokens) a load can serve."""


def spec_config(dtype: torch.dtype) -> Callable[[Any], KVCacheConfig]:
    """One full-attention group of ``dtype`` pages with 2 heads of 64, as vLLM's CPU backend resolves it."""

    def build(_: Any) -> KVCacheConfig:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)], kv_cache_layout="LBHNC")

    return build


def kv_of(dtype: torch.dtype) -> Callable[[KVCacheConfig], dict[str, torch.Tensor]]:
    """vLLM's CPU KV cache in ``dtype``: one ``[blocks, H, N, 2D]`` view per layer of one storage."""

    def build(config: KVCacheConfig) -> dict[str, torch.Tensor]:
        storage = torch.zeros((len(LAYERS), config.num_blocks, HEADS, BLOCK, 2 * HEAD), dtype=dtype)
        return {name: storage[i] for i, name in enumerate(LAYERS)}

    return build


class FloatModel:
    """A "model" writing float pages of ``dtype``; a page read is right within int8's bound over groups of ``group``
    (and ``lossy`` counts the pages read that are not bit-equal: what int8 changed)."""

    def __init__(self, dtype: torch.dtype, group: int) -> None:
        self.dtype, self.group, self.lossy = dtype, group, 0

    def page(self, layer: int, prefix: list[int], size: int) -> torch.Tensor:
        return value_page((layer, prefix), size // self.dtype.itemsize, self.dtype, self.group).view(torch.uint8)

    def same(self, read: torch.Tensor, expected: torch.Tensor) -> bool:
        self.lossy += not torch.equal(read, expected)
        return within_int8_bound(expected.view(self.dtype), read.view(self.dtype), self.group)

    def runs(self, instance: Instance) -> Instance:
        instance.page_of, instance.same_page = self.page, self.same
        return instance


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_int8_pages_restore_a_prompt_on_a_fresh_instance_and_an_exact_one_recomputes(
    vllm: Instances, dtype: str
) -> None:
    model = FloatModel(DTYPES[dtype], HEAD)
    remote = simulated_remote()
    built = {"kv_config": spec_config(DTYPES[dtype]), "kv": kv_of(DTYPES[dtype])}
    first = model.runs(vllm.new("first", cpu_topology(remotes=[remote]), options=INT8, **built))
    (coded,) = tiers_of(first).parts.remotes
    assert isinstance(coded, CodedTier) and coded.config.levels == [Level.INT8]
    assert coded.coding.geometry.channels == HEAD and coded.coding.geometry.dtype == dtype
    saved = first.serve(request("a", PROMPT))
    remote_written(first, "sim", USABLE)
    assert model.lossy == 0 and not [wrong for record in saved for wrong in record.wrong_pages]

    second = model.runs(vllm.new("second", cpu_topology(remotes=[remote]), options=INT8, **built))
    records = second.serve(request("b", PROMPT))
    assert second.new_request(records, "b").num_computed_tokens == USABLE * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages], "every page within int8's bound"
    assert model.lossy > 0, "the pages read are int8's, not the exact bytes"
    counts = totals(records)
    assert counts["loaded_blocks"] == USABLE and counts["level_blocks:int8"] == USABLE
    assert counts.get("failed_loads", 0) == 0 and not any(record.invalid_blocks for record in records)

    exact = model.runs(vllm.new("exact", cpu_topology(remotes=[remote]), **built))
    records = exact.serve(request("c", PROMPT))
    assert exact.new_request(records, "c").num_computed_tokens == 0, "an exact reader never loads int8 values"
    assert sum(record.external_hits for record in records) == 0
    assert "loaded_blocks" not in totals(records)


def test_a_sliding_window_models_groups_restore_their_windows_from_int8(vllm: Instances) -> None:
    model = FloatModel(torch.float32, GROUP_HEAD_SIZE)
    remote = simulated_remote()
    long = list(range(2000, 2400))
    topology = cpu_topology(blocks=200, remotes=[remote])
    first = model.runs(vllm.new("first", topology, options=INT8, kv_config=kv_config_of("SF")))
    saved = first.serve(request("a", long))
    remote_written(first, "sim", totals(saved)["stored_blocks"])
    second = model.runs(vllm.new("second", topology, options=INT8, kv_config=kv_config_of("SF")))
    records = second.serve(request("b", long))
    usable = (len(long) - 1) // BLOCK
    assert sum(record.external_hits for record in records) == usable * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages] and model.lossy > 0
    counts = totals(records)
    assert counts["loaded_blocks"] == usable + WINDOW_BLOCKS == counts["level_blocks:int8"]


def test_tp_ranks_pages_are_groups_of_the_head_size_and_the_format_names_dtype_and_group(vllm: Instances) -> None:
    prints = set()
    for dtype, world in (("bfloat16", 2), ("float16", 2), ("bfloat16", 1)):
        config = vllm_config(vllm.model, f"tp{world}", vllm.extra(cpu_topology(remotes=[simulated_remote()])),
                             tensor_parallel_size=world)
        kv = spec_config(DTYPES[dtype])(config)
        slots = instance_geometry(config, kv).slots
        assert slots is not None and (slots.element_dtype, slots.group_elements, slots.world) == (dtype, HEAD, world)
        options = ConnectorOptions.parse({**config.kv_transfer_config.kv_connector_extra_config, **INT8})
        topology = options.config(model_identity(config), slots, page_format(config, kv, slots))
        tier = build_tier(topology.tiers[1], model_namespace(topology)[1], topology.layout.bytes_per_block,
                          topology.layout)
        assert isinstance(tier, CodedTier)
        page = BLOCK * HEADS * 2 * HEAD  # elements of one layer's page on one rank
        assert tier.coding.geometry.groups == world * len(LAYERS) * page // HEAD, "every rank's share, in groups"
        fields = topology.layout.page_format().fields
        assert (fields["element_dtype"], fields["group_elements"]) == (dtype, HEAD)
        prints.add(model_namespace(topology)[0].page_format)
    assert len(prints) == 3, "another dtype or world: another namespace"
