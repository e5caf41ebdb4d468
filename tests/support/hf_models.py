"""Tiny random-weight ``transformers`` models built from configs (never downloaded), and topologies that fit them.

Two full-attention architectures: a Llama with grouped-query attention (head
dim = hidden / heads) and a Qwen3, whose config sets ``head_dim`` explicitly to
twice hidden / heads and whose attention normalises q and k. Four with sliding
windows of ``WINDOW`` tokens (shorter than the prompts): a Mistral (every layer
sliding), a Gemma2 and a Gemma3 (sliding and full layers alternating, Gemma3
with its own RoPE base for the sliding ones) and a Qwen2 whose upper layer
slides (``max_window_layers``). ``Replay`` is the reference a cached run must
equal bit for bit: the same forward calls on a plain ``DynamicCache`` that keeps
every position, as the pool does (the model's mask applies the window), cropped
to what tiercache reused, so every K/V the model reads was computed by the same
kernel calls as the one it read from the pool.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tiercache import TierManager
from tiercache.blocks.layout import KVLayout
from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.integrations.transformers import CachedModel, cache_argument

VOCAB = 256
BLOCK_SIZE = 4
ARCHITECTURES = ("llama", "qwen3")
SLIDING_ARCHITECTURES = ("mistral", "gemma2", "gemma3", "qwen2")
WINDOW = 6
"""The sliding window of the sliding architectures, in tokens: shorter than every prompt the tests serve."""
MEMORY_ORDERS = ("block_major", "layer_major")
GPU_BLOCKS, CPU_BLOCKS = 64, 128
MODEL_SEED = 0
PAD_TOKEN = 0
"""Prompts use ids from 1 up; no EOS is configured, so every reply has its full length."""
PREFIX_BLOCKS = 5
"""A two-request test: the first stores ``PREFIX`` tokens, the second reuses them and computes ``SUFFIX`` more."""
PREFIX = PREFIX_BLOCKS * BLOCK_SIZE
SUFFIX = 3
DECODE_STEPS = 6
RECOMPUTE_TOLERANCE = 1e-5
"""A cache-less recompute runs other matrix product shapes: it agrees within this, not bit for bit."""
GENERATE = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}


def tiny_config(arch: str, window: int = WINDOW) -> Any:
    """A two-layer config of ``arch`` with grouped-query attention (4 query heads, 2 KV heads).

    ``window``: the sliding window of the sliding architectures.
    """
    common = {
        "vocab_size": VOCAB,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": PAD_TOKEN,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    sliding = {**common, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "sliding_window": window}
    alternating = ["sliding_attention", "full_attention"]
    if arch == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, **common)
    if arch == "qwen3":
        return Qwen3Config(hidden_size=48, head_dim=24, intermediate_size=96, **common)
    if arch == "mistral":
        return MistralConfig(**sliding)
    if arch == "gemma2":
        return Gemma2Config(layer_types=alternating, **sliding)
    if arch == "gemma3":
        return Gemma3TextConfig(layer_types=alternating, **sliding)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=True, max_window_layers=1, **sliding)
    raise ValueError(f"unknown architecture {arch!r}")


MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def tiny_model(arch: str, seed: int = MODEL_SEED, window: int = WINDOW) -> Any:
    """Seeded random weights (float32, eval mode); the global RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MODEL_CLASSES[arch](tiny_config(arch, window)).eval()


def topology(
    model: Any,
    memory: str = "block_major",
    remotes: list[dict[str, Any]] | None = None,
    gpu_blocks: int = GPU_BLOCKS,
    gpu_policy: str = "lru",
) -> TierCacheConfig:
    """GPU pool (on the CPU) + CPU tier (+ remotes), with the layout read from the model's config."""
    layout = KVLayout.from_hf_config(model.config, block_size=BLOCK_SIZE, memory=memory)
    gpu = {"name": "gpu", "type": "gpu", "capacity_blocks": gpu_blocks, "policy": gpu_policy}
    tiers: list[dict[str, Any]] = [
        {**gpu, "options": {"device": "cpu"}},
        {"name": "cpu", "type": "cpu", "capacity_blocks": CPU_BLOCKS, "write_policy": "write_through"},
    ]
    fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
    data = {
        "model": {"id": f"tiny-{model.config.model_type}"},
        "layout": {**{name: getattr(layout, name) for name in fields}, "memory": memory},
        "tiers": tiers + (remotes or []),
    }
    return config_from_dict(data, environ={})


def random_tokens(count: int, seed: int) -> torch.Tensor:
    """``[1, count]`` token ids in ``1 .. VOCAB-1``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, count), generator=generator)


def generate(model: Any, input_ids: torch.Tensor, cache: Any, max_new_tokens: int) -> Any:
    """Greedy ``generate`` keeping every step's logits."""
    return model.generate(
        input_ids,
        **cache_argument(model, cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


class Replay:
    """One conversation's reference: the same calls on a ``DynamicCache`` (the KV history the pool holds)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = DynamicCache()
        """Built without the config: every layer keeps every position, sliding ones too, as the pool does."""

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> None:
        """A forward pass over ``input_ids`` continuing the history (how a prefix was first computed)."""
        self.model(input_ids[:, self.cache.get_seq_length() :], **cache_argument(self.model, self.cache))

    def turn(self, input_ids: torch.Tensor, reused_tokens: int, max_new_tokens: int) -> Any:
        """The request again, starting from the first ``reused_tokens`` of the history."""
        self.cache.crop(reused_tokens - self.cache.get_seq_length())
        return generate(self.model, input_ids, self.cache, max_new_tokens)


def assert_bitwise(expected: Any, got: Any) -> None:
    """Same tokens and bit-identical logits at every step."""
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert len(got.logits) == len(expected.logits)
    for want, have in zip(expected.logits, got.logits, strict=True):
        assert torch.equal(want, have), (want - have).abs().max()


# ---- the two-request check the driver tests share -------------------------------------------------
def store_prefix(manager: TierManager, model: Any, prefix: torch.Tensor) -> None:
    """The first request: prefill ``prefix`` in one pass (one new token) and store its blocks.

    Waiting for the store means its copies down (and the write-through puts they
    start) are in flight before the engine closes, so ``close`` drains them.
    """
    turn = CachedModel(model, manager).generate(prefix, max_new_tokens=1, do_sample=False)
    assert turn.cached_tokens == 0
    assert turn.stored is not None and turn.stored.result() == prefix.shape[1]


def evict_gpu(manager: TierManager) -> None:
    """Push every cached block out of the GPU pool (they live on in the CPU tier)."""
    manager.release(manager.allocate(manager.gpu.num_blocks))


def reuse(manager: TierManager, model: Any, prompt: torch.Tensor, source: str, force_latest: bool = False) -> Any:
    """The second request: it must reuse exactly the prefix, from ``source``, and compute the suffix."""
    turn = CachedModel(model, manager).generate(prompt, DECODE_STEPS, force_latest=force_latest, **GENERATE)
    assert turn.reused[source] == PREFIX, turn.reused
    assert turn.cached_tokens == PREFIX and turn.computed_tokens == SUFFIX
    return turn.output


def expected(model: Any, prompt: torch.Tensor) -> Any:
    replay = Replay(model)
    replay.prefill(prompt[:, :PREFIX])
    return replay.turn(prompt, PREFIX, DECODE_STEPS)


def check(model: Any, prompt: torch.Tensor, got: Any) -> None:
    assert_bitwise(expected(model, prompt), got)
    recomputed = generate(model, prompt, None, DECODE_STEPS)
    assert got.sequences.tolist() == recomputed.sequences.tolist()
    for want, have in zip(recomputed.logits, got.logits, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=RECOMPUTE_TOLERANCE)
