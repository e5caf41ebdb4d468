"""KVLayout.from_hf_config: the KV shape of a transformers model from its config, or a clear refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiercache import KVLayout, MemoryOrder, UnsupportedModelError

transformers = pytest.importorskip("transformers")


def test_llama_with_grouped_query_attention() -> None:
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=6
    )
    layout = KVLayout.from_hf_config(config, block_size=32)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (6, 2, 32)
    assert (layout.dtype, layout.block_size, layout.memory) == ("float32", 32, MemoryOrder.BLOCK_MAJOR)


def test_explicit_head_dim_wins_over_hidden_by_heads() -> None:
    config = transformers.Qwen3Config(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    layout = KVLayout.from_hf_config(config, dtype=torch.bfloat16, memory="layer_major")
    assert (layout.num_kv_heads, layout.head_dim, layout.dtype) == (2, 24, "bfloat16")
    assert layout.memory is MemoryOrder.LAYER_MAJOR


def test_dtype_comes_from_the_config_when_not_given() -> None:
    config = transformers.LlamaConfig(num_hidden_layers=2, dtype="float16")
    assert KVLayout.from_hf_config(config).dtype == "float16"


def test_kv_heads_default_to_attention_heads() -> None:
    class Plain:
        num_hidden_layers, num_attention_heads, hidden_size = 2, 4, 64

    layout = KVLayout.from_hf_config(Plain())
    assert (layout.num_kv_heads, layout.head_dim) == (4, 16)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (lambda: transformers.MambaConfig(), "state-space layers"),
        (lambda: transformers.Llama4TextConfig(), "layers of type chunked_attention"),
        (lambda: transformers.Gemma3nTextConfig(), "KV shared between layers"),
        (lambda: transformers.JambaConfig(), "layers of type linear_attention"),
        (lambda: transformers.Qwen3NextConfig(), "linear_attention"),
        (lambda: transformers.DeepseekV3Config(), "latent"),
        (lambda: transformers.T5Config(), "encoder-decoder"),
    ],
)
def test_caches_that_are_not_plain_kv_are_refused(config: Any, reason: str) -> None:
    with pytest.raises(UnsupportedModelError, match=reason) as raised:
        KVLayout.from_hf_config(config())
    assert "not supported" in str(raised.value)


@pytest.mark.parametrize(
    "config",
    [
        lambda: transformers.MistralConfig(num_hidden_layers=2),
        lambda: transformers.Gemma2Config(num_hidden_layers=2),
        lambda: transformers.Gemma3TextConfig(num_hidden_layers=2),
        lambda: transformers.Cohere2Config(num_hidden_layers=2),
        lambda: transformers.GptOssConfig(num_hidden_layers=2),
        lambda: transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1),
    ],
    ids=["mistral", "gemma2", "gemma3", "cohere2", "gpt-oss", "qwen2-hybrid"],
)
def test_sliding_window_layers_are_plain_kv(config: Any) -> None:
    """Sliding and full attention layers both keep plain K/V (the model's mask applies the window)."""
    loaded = config()
    assert loaded.sliding_window
    assert KVLayout.from_hf_config(loaded).num_layers == 2


def test_a_sliding_window_that_is_switched_off_is_plain_kv() -> None:
    config = transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)
    assert KVLayout.from_hf_config(config).num_layers == 2


def test_a_config_without_the_fields_names_the_missing_one() -> None:
    with pytest.raises(ValueError, match=r"config.num_attention_heads must be a positive integer"):
        KVLayout.from_hf_config(object())
