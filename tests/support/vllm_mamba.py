"""vLLM 0.33's Mamba ``align`` mode for ``support.vllm_connector.Instance``: its KV cache config, tensors and state.

``align_config(pattern)`` is vLLM's own planner over ``F`` (full attention) and
``M`` (a state layer: ``MambaSpec`` with ``mamba_cache_mode="align"``) layers,
with prefix caching on, as vLLM runs a hybrid with state caching.
``align_tensors`` is one backing allocation laid out as the planner's
``kv_cache_tensors`` say: the page views the "model" writes, and what vLLM 0.33
registers with a connector (a state layer as the raw allocation itself; an
attention layer as its view).

``AlignState`` is the state layers' "model", what vLLM's worker does in align
mode (``vllm/v1/worker/mamba_utils.py``, ``preprocess_mamba``): before a step's
forward (and before the connector's loads), each request's state is copied from
the block that holds it (the previous step's, or for a new or resumed request,
the block before its first token, ``(computed - 1) // block_size``) to the
block the step ends in (``cdiv(end, block_size) - 1``); the forward continues
it there and leaves the state after the step's last token. The state after
``n`` tokens is ``page_bytes(layer + STATE_SEED, tokens[:n])``: a block read as
a step's initial state must hold exactly that for the step's first token, or
it is a wrong page.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec

from support.vllm_connector import Instance, page_bytes
from support.vllm_groups import HYBRID_BLOCKS, LAYOUT, layer_name
from support.vllm_parts import BLOCK, HEAD_SIZE, KV_HEADS, PAGE_SHAPE

STATE_SEED = 1000
"""Keeps a state layer's "state" apart from any K/V page the model computes."""
STATE_FLOATS = KV_HEADS * BLOCK * 2 * HEAD_SIZE
"""A state of one page's size (vLLM pads state and attention pages to one size)."""


def align_specs(pattern: str) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for index, kind in enumerate(pattern):
        if kind == "F":
            specs[layer_name(index)] = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS,
                                                         head_size=HEAD_SIZE, dtype=torch.float32)
        else:
            specs[layer_name(index)] = MambaSpec(block_size=BLOCK, shapes=((STATE_FLOATS,),), dtypes=(torch.float32,),
                                                 mamba_cache_mode="align")
    return specs


def align_config(pattern: str, blocks: int = HYBRID_BLOCKS) -> Callable[[VllmConfig], KVCacheConfig]:
    """A builder of the KV cache config vLLM makes for ``pattern`` in align mode (prefix caching on)."""

    def build(config: VllmConfig) -> KVCacheConfig:
        assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config), "vLLM would turn its allocator off"
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        config.cache_config.kv_cache_layout = LAYOUT
        config.cache_config.num_gpu_blocks = blocks
        config.cache_config.enable_prefix_caching = True
        config.cache_config.mamba_cache_mode = "align"
        groups = get_kv_cache_groups(config, align_specs(pattern))
        page = groups[0].kv_cache_spec.page_size_bytes
        per_block = page * max(len(group.layer_names) for group in groups)
        return get_kv_cache_config_from_groups(config, groups, blocks * per_block)

    return build


def align_tensors(config: KVCacheConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the "model"'s page views per layer, what vLLM 0.33 registers): one allocation, as the planner places it."""
    item = torch.float32.itemsize
    state_layers = {name for group in config.kv_cache_groups if isinstance(group.kv_cache_spec, MambaSpec)
                    for name in group.layer_names}
    views: dict[str, torch.Tensor] = {}
    registered: dict[str, torch.Tensor] = {}
    page = [KV_HEADS * BLOCK * 2 * HEAD_SIZE, BLOCK * 2 * HEAD_SIZE, 2 * HEAD_SIZE, 1]
    (size,) = {placed.size for placed in config.kv_cache_tensors}  # vLLM: one backing allocation for all
    backing = torch.full((size // item,), -1.0, dtype=torch.float32)
    for placed in config.kv_cache_tensors:
        for index, name in enumerate(placed.layers):
            start = (placed.offset + index * placed.layer_stride) // item
            if name in state_layers:
                views[name] = backing.as_strided((config.num_blocks, STATE_FLOATS), (placed.block_stride // item, 1),
                                                 start)
                registered[name] = backing.view(torch.int8)  # vLLM 0.33: a spec without layer views gets the raw one
            else:
                views[name] = backing.as_strided((config.num_blocks, *PAGE_SHAPE), (placed.block_stride // item,
                                                                                    *page[1:]), start)
                registered[name] = views[name]
    return views, registered


class AlignState:
    """What vLLM's worker does to the state layers' blocks in align mode (see the module docstring)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.state_idx: dict[str, int] = {}
        """Per request, the block its state is in after its last step (vLLM's ``mamba_state_idx``)."""

    def state(self, layer: int, tokens: list[int], size: int) -> torch.Tensor:
        return page_bytes(layer + STATE_SEED, tokens, size)

    def _layers(self) -> list[tuple[int, int, str]]:
        inst = self.instance
        return [(group, index, name) for index, name in enumerate(inst.layers)
                for group in [inst.group_of[name]] if group in inst.state_groups]

    def prepare(self, output: Any) -> list[tuple[str, str, int]]:
        """``preprocess_mamba``: each request's state moved to the block its step ends in, and checked there."""
        inst, wrong = self.instance, []
        preempted = output.preempted_req_ids or set()
        resumed = output.scheduled_cached_reqs.resumed_req_ids
        for req_id in itertools.chain(output.finished_req_ids, preempted, resumed):
            self.state_idx.pop(req_id, None)
        for req, start, end in inst._scheduled(output):
            prev = self.state_idx.get(req.request_id, (start - 1) // BLOCK)
            curr = cdiv(end, BLOCK) - 1
            self.state_idx[req.request_id] = curr
            tokens = list(req.all_token_ids)
            for group, index, name in self._layers():
                blocks = inst.block_ids(req.request_id, group)
                view = inst.kv[name]
                if prev != -1 and prev != curr:
                    view[blocks[curr]].copy_(view[blocks[prev]])
                expected = self.state(index, tokens[:start], view[0].numel() * view.element_size())
                if start and (blocks[curr] == 0 or not torch.equal(view[blocks[curr]].view(torch.uint8), expected)):
                    wrong.append((req.request_id, name, curr))
        return wrong

    def compute(self, output: Any, layer: int, name: str, requests: set[str] | None) -> None:
        """The layer's forward: the state after the step's last token, in the block the step ends in."""
        inst = self.instance
        group = inst.group_of[name]
        if group not in inst.state_groups:
            return
        view = inst.kv[name]
        for req, _, end in inst._scheduled(output):
            if requests is not None and req.request_id not in requests:
                continue
            block = inst.block_ids(req.request_id, group)[cdiv(end, BLOCK) - 1]
            state = self.state(layer, list(req.all_token_ids)[:end], view[0].numel() * view.element_size())
            view[block].copy_(state.view(view.dtype))
