"""Sliding-window models served through tiercache: reused KV continues exactly, the window still applies.

Every layer of a Mistral, Gemma2, Gemma3 or Qwen2 with sliding layers keeps
plain K/V; a sliding layer only attends to the last ``WINDOW`` positions, which
the model's attention mask decides. The pool keeps every position of a prompt,
so a reused prefix is the same K/V a plain ``DynamicCache`` that keeps every
position holds: bit for bit against that (``Replay``), and within 1e-5 of
``generate`` with the model's own (windowed) cache from scratch. The prompts are
longer than the window, so the window shapes every output (checked first).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from support.hf_models import (
    DECODE_STEPS,
    PREFIX,
    SLIDING_ARCHITECTURES,
    SUFFIX,
    WINDOW,
    check,
    evict_gpu,
    generate,
    random_tokens,
    reuse,
    store_prefix,
    tiny_model,
    topology,
)

from tiercache import TierManager

WINDOW_EFFECT = 1e-3
"""The same weights without the window must move some logit by more than this (it is about 1e-1 here)."""
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES)
def test_the_window_shapes_these_prompts(arch: str) -> None:
    """Without this, the tests below could pass on a model whose window never mattered."""
    prompt = random_tokens(PREFIX + SUFFIX, seed=11)
    assert prompt.shape[1] > WINDOW
    windowed = generate(tiny_model(arch), prompt, None, DECODE_STEPS)
    unbounded = generate(tiny_model(arch, window=prompt.shape[1] + DECODE_STEPS), prompt, None, DECODE_STEPS)
    difference = max((a - b).abs().max().item() for a, b in zip(windowed.logits, unbounded.logits, strict=True))
    assert difference > WINDOW_EFFECT


@pytest.mark.parametrize("source", ["gpu", "cpu"])
@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES)
def test_sliding_window_hit_continues_bitwise(arch: str, source: str) -> None:
    """Old code: ``UnsupportedModelError`` (a sliding window, or layers of type sliding_attention)."""
    model, prompt = tiny_model(arch), random_tokens(PREFIX + SUFFIX, seed=12)
    with TierManager(topology(model, "layer_major")) as manager:
        store_prefix(manager, model, prompt[:, :PREFIX])
        if source == "cpu":
            evict_gpu(manager)
        got = reuse(manager, model, prompt, source)
    check(model, prompt, got)


def test_sliding_window_hit_through_redis_in_a_fresh_engine(redis_server: Any) -> None:
    """Engine A stores a Gemma2's prefix in Redis; engine B (empty GPU and CPU tiers) continues it bitwise."""
    model, prompt = tiny_model("gemma2"), random_tokens(PREFIX + SUFFIX, seed=13)
    remote = {"name": "redis", "type": "redis", "options": {"url": redis_server.url}}
    with TierManager(topology(model, "block_major", [remote])) as engine_a:
        store_prefix(engine_a, model, prompt[:, :PREFIX])
    with TierManager(topology(model, "block_major", [remote])) as engine_b:
        got = reuse(engine_b, model, prompt, "redis")
    check(model, prompt, got)


def test_a_window_is_part_of_the_models_identity() -> None:
    """Two models that differ only in their window (same weights, same KV shape) never share KV."""
    narrow, wide = tiny_model("mistral"), tiny_model("mistral", window=2 * WINDOW)
    prompt = random_tokens(PREFIX + SUFFIX, seed=14)
    with TierManager(topology(narrow)) as manager:
        store_prefix(manager, narrow, prompt[:, :PREFIX])
        store_prefix(manager, wide, prompt[:, :PREFIX])
    assert torch.equal(narrow.lm_head.weight, wide.lm_head.weight)
