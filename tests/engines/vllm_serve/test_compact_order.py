"""The token map read from vLLM's own CPU kernel: K and V that ``cpu_attn_reshape_and_cache`` writes into a
block, as vLLM's CPU backend views its cache (``[blocks, heads, tokens, 2 * head_size]`` seen as
``[.., 2 * tokens, head_size]`` and chunked), read back through the map, are the K and V written, for each kernel
ISA this machine picks (``vec``, ``vec16``) and every float dtype; a model this order cannot describe gets none,
with a reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import _custom_ops as ops

from tiercache.blocks.token_map import PageTokenMap
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.token_order import CPU_BACKEND, TokenOrder, token_order

SHAPES = [(32, 64), (32, 128), (16, 64), (32, 80)]
"""(block size, head size): 32/64 and 32/128 run the ``vec`` kernel (``amx`` for bfloat16 on an AMX CPU), 16 and
head size 80 ``vec16``."""
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS, LAYERS = 3, 2


def configs(dtype: torch.dtype, block: int, head: int, spec_name: str = "FullAttentionSpec",
            head_v: int | None = None) -> tuple[SimpleNamespace, SimpleNamespace, SlotGeometry]:
    """vLLM's config fields the order reads, its one KV-cache group, and the connector's slot geometry."""
    name = str(dtype).removeprefix("torch.")
    spec = type(spec_name, (), {"head_size": head, "head_size_v": head_v or head, "num_kv_heads": HEADS,
                                "block_size": block})()
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"),
                                  model_config=SimpleNamespace(dtype=dtype))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    page = HEADS * 2 * block * head * dtype.itemsize
    group = GroupGeometry(GroupKind.FULL, tuple(f"layer.{i}" for i in range(LAYERS)), page)
    return vllm_config, kv_cache_config, SlotGeometry((group,), 1, block, name, head)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block", "head"), SHAPES)
def test_the_map_reads_back_what_vllms_cpu_kernel_wrote(dtype: torch.dtype, block: int, head: int) -> None:
    order = token_order(*configs(dtype, block, head))
    token_map = order.token_map
    assert isinstance(token_map, PageTokenMap) and order.backends == (CPU_BACKEND,)
    generator = torch.Generator().manual_seed(block * head)
    keys = torch.randn(LAYERS, block, HEADS, head, generator=generator).to(dtype)
    values = torch.randn(LAYERS, block, HEADS, head, generator=generator).to(dtype)
    cache = torch.zeros(LAYERS, 2, HEADS, block, 2 * head, dtype=dtype)  # two blocks a layer; the second is used
    isa = token_map.source.split("(")[1].split()[0]
    for layer in range(LAYERS):
        key_cache, value_cache = cache[layer].view(2, HEADS, 2 * block, head).chunk(2, dim=2)  # cpu_attn.py's view
        slots = torch.arange(block, 2 * block)
        ops.cpu_attn_reshape_and_cache(keys[layer], values[layer], key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
    block_pages = cache[:, 1].contiguous().flatten()  # the slot: [layer][page] of the second block
    read = block_pages[token_map.index()]
    assert torch.equal(read[:, 0], keys.flatten(-2)) and torch.equal(read[:, 1], values.flatten(-2))
    assert isa == expected_isa(dtype, block, head)


def expected_isa(dtype: torch.dtype, block: int, head: int) -> str:
    """The x86 kernel vLLM's CPU backend runs for this shape: ``vec16`` for blocks or heads not a multiple of 32,
    ``amx`` for bfloat16 where the CPU has AMX tiles, ``vec`` otherwise."""
    if block % 32 or head % 32:
        return "vec16"
    return "amx" if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else "vec"


def test_a_model_the_order_cannot_describe_gets_no_map_and_a_reason() -> None:
    for fields, reason in ((("MLAAttentionSpec",), "MLAAttentionSpec"), (("FullAttentionSpec", 32), "head sizes")):
        vllm_config, kv_cache_config, geometry = configs(torch.float16, 32, 64, *fields)
        order = token_order(vllm_config, kv_cache_config, geometry)
        assert order.token_map is None and reason in str(order.why_not)


def test_a_worker_whose_layers_run_another_backend_is_told_why() -> None:
    order = token_order(*configs(torch.float32, 32, 64))
    assert order.mismatch({"layer.0": CPU_BACKEND, "layer.1": CPU_BACKEND}) is None
    assert "FLASH_ATTN" in str(order.mismatch({"layer.0": "FLASH_ATTN"}))
    assert TokenOrder(None).mismatch({"layer.0": "FLASH_ATTN"}) is None, "no map in use: nothing to hold"
