"""Tiny random-weight hybrid ``transformers`` models (state layers beside attention) and topologies that fit them.

Three families, each with its own kind of state layer: Qwen3-Next (gated delta
net: a short convolution and a recurrent state per layer), Nemotron-H (Mamba-2
layers, an MLP-only layer, one attention layer) and Falcon-H1 (every layer runs
attention and Mamba-2 side by side). ``Replay`` is the reference a restored run
must equal bit for bit: the same forward calls, chunk for chunk, on the model's
own ``DynamicCache``, whose states then are the very states the first request
saved.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from tiercache.blocks.layout import KVLayout
from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.integrations.transformers import cache_argument

FAMILIES = ("qwen3_next", "nemotron_h", "falcon_h1")
MORE_FAMILIES = ("qwen3_5_text", "bamba", "granitemoehybrid")
"""Checked against the replay in the GPU pool only: another gated delta net, and two more Mamba-2 hybrids."""
VOCAB = 256
BLOCK_SIZE = 4
EVERY_BLOCKS = 2
"""Anchors every two blocks: a prompt of a few blocks stops at one or two of them."""
GPU_BLOCKS, CPU_BLOCKS = 256, 512
RECOMPUTE_TOLERANCE = 1e-5
GENERATE = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextConfig", {
        **_SMALL, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}),
    "nemotron_h": ("NemotronHConfig", {
        **_SMALL, "num_hidden_layers": 4, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16,
        "ssm_state_size": 16, "n_groups": 1, "hybrid_override_pattern": "M-M*"}),
    "falcon_h1": ("FalconH1Config", {
        **_SMALL, "num_hidden_layers": 2, "head_dim": 16, "mamba_n_heads": 4, "mamba_d_head": 16,
        "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_ssm": 64}),
    "qwen3_5_text": ("Qwen3_5TextConfig", {
        **_SMALL, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "bamba": ("BambaConfig", {
        **_SMALL, "num_hidden_layers": 4, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
        "mamba_n_groups": 1, "attn_layer_indices": [3]}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        **_SMALL, "num_hidden_layers": 4, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
        "mamba_n_groups": 1, "layer_types": ["mamba", "mamba", "mamba", "attention"], "num_local_experts": 2,
        "num_experts_per_tok": 1}),
}


def hybrid_config(family: str) -> Any:
    name, fields = CONFIGS[family]
    config = getattr(transformers, name)(**fields)
    config._attn_implementation = "eager"
    return config


def hybrid_model(family: str, seed: int = 0) -> Any:
    """Seeded random weights (float32, eval mode); the global RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hybrid_config(family)).eval()


def hybrid_topology(model: Any, remotes: list[dict[str, Any]] | None = None,
                    gpu_blocks: int = GPU_BLOCKS) -> TierCacheConfig:
    """GPU pool (on the CPU) + CPU tier (+ remotes), the layout of the model's K/V layers."""
    layout = KVLayout.from_hf_config(model.config, block_size=BLOCK_SIZE, with_state=True)
    fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
    tiers = [{"name": "gpu", "type": "gpu", "capacity_blocks": gpu_blocks, "options": {"device": "cpu"}},
             {"name": "cpu", "type": "cpu", "capacity_blocks": CPU_BLOCKS, "write_policy": "write_through"}]
    data = {"model": {"id": f"tiny-{model.config.model_type}"},
            "layout": {name: getattr(layout, name) for name in fields}, "tiers": tiers + (remotes or [])}
    return config_from_dict(data, environ={})


def random_tokens(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, count), generator=generator)


def chunk_ends(start: int, prompt_tokens: int, every: int = EVERY_BLOCKS) -> list[int]:
    """Where ``CachedModel`` stops a hybrid's prefill from ``start`` blocks: each anchor, the last boundary."""
    last = (prompt_tokens - 1) // BLOCK_SIZE
    return [b * BLOCK_SIZE for b in range(start + 1, last + 1) if b % every == 0 or b == last]


class Replay:
    """The same forward calls on the model's own ``DynamicCache``: what a restored request must equal."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, ends: list[int]) -> None:
        for end in ends:
            self.model(input_ids[:, self.cache.get_seq_length() : end], **cache_argument(self.model, self.cache))

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Any:
        return self.model.generate(input_ids, **cache_argument(self.model, self.cache),
                                   max_new_tokens=max_new_tokens, **GENERATE)


def assert_bitwise(expected: Any, got: Any) -> None:
    assert got.sequences.tolist() == expected.sequences.tolist()
    for want, have in zip(expected.logits, got.logits, strict=True):
        assert torch.equal(want, have), (want - have).abs().max()


def assert_recompute(model: Any, prompt: torch.Tensor, got: Any, max_new_tokens: int) -> None:
    """Greedy tokens equal and every step's logits within ``RECOMPUTE_TOLERANCE`` of a cache-less run."""
    recomputed = model.generate(prompt, max_new_tokens=max_new_tokens, **GENERATE)
    assert got.sequences.tolist() == recomputed.sequences.tolist()
    for want, have in zip(recomputed.logits, got.logits, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=RECOMPUTE_TOLERANCE)
