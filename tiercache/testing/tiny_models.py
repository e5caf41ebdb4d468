"""Small random-weight hybrid and sliding-window models built locally (no hub), for vLLM's hybrid KV-cache tests.

``build_tiny_model(dir, family)`` writes what ``vllm serve dir`` reads, like
``tiny_llama.build_tiny_llama``: the config, seeded float32 safetensors weights
and the same word-level tokenizer (vocab 4096, ``prompt_text`` and
``random_prompt_ids`` work unchanged). Every family has hidden size 256, 4
layers, untied embeddings (but Gemma 2 and Zamba2: vLLM always ties them) and
``initializer_range=0.1`` where the config has one (random logits far from
flat). Sliding windows are ``SLIDING_WINDOW`` (128) tokens: 4 blocks of 32, far
shorter than the tests' 1500+-token prompts.
``FAMILY_ARGS`` holds the extra ``vllm serve`` flags each family needs on the
CPU build (0.32) and what vLLM made of it with ``--block-size 32`` (KV-cache
groups, block sizes), with its hybrid KV-cache allocator on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiercache.testing.tiny_llama import BOS_ID, EOS_ID, UNK_ID, build_once, save_tokenizer

FAMILIES = ("gemma2", "gemma3", "mistral_sliding", "nemotron_h", "falcon_h1", "zamba2", "granitemoehybrid")
MAMBA_FAMILIES = ("nemotron_h", "falcon_h1", "zamba2", "granitemoehybrid")
"""The families with Mamba (SSM) layers: the connector restores their state with prefix caching on (vLLM's align
mode), and declines them without it."""
MARKER = "tiny_model.json"
"""Written last, with the build's arguments (and ``REVISION``): a directory holding it is complete."""
REVISION = 1
"""Bumped whenever a family's config changes, so that older builds are replaced."""
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 4096
MAX_POSITIONS = 8192
SLIDING_WINDOW = 128
INIT_RANGE = 0.1
GEMMA2_POST_NORM = 9.0
MAMBA_HEADS = 8
MAMBA_HEAD_DIM = 2 * HIDDEN // MAMBA_HEADS
"""Mamba2 layers expand the hidden size 2x: 8 heads of 64."""
MAMBA_STATE = 16
MAMBA_CHUNK = 128


@dataclass(frozen=True)
class FamilyArgs:
    """What a family needs from ``vllm serve`` (``args``) and what the server made of it (``description``)."""

    args: tuple[str, ...]
    description: str


NO_PREFIX_CACHING = ("--no-enable-prefix-caching",)
"""Mamba hybrids: prefix caching puts Mamba state in "align" mode, whose CPU prefill of a prompt longer than a block
fails (``IndexError`` at ``varlen_states[last_chunk_indices_p]`` in ``mamba_mixer2.py``) and kills the engine, unless
the prefill checkpoint block is turned off (``tests/support/vllm_cpu_mamba``, docs/engines.md)."""
FAMILY_ARGS: dict[str, FamilyArgs] = {
    "gemma2": FamilyArgs((), "Gemma2ForCausalLM; 2 KV-cache groups of 2 layers: sliding 128 (layers 0, 2), full "
                             "(1, 3); block 32"),
    "gemma3": FamilyArgs((), "Gemma3ForCausalLM; 4 KV-cache groups of 1 layer: sliding 128 (layers 0-2), full (3); "
                             "block 32"),
    "mistral_sliding": FamilyArgs((), "MistralForCausalLM; 1 KV-cache group: all 4 layers sliding 128; block 32"),
    "nemotron_h": FamilyArgs(NO_PREFIX_CACHING, "NemotronHForCausalLM M*M- (Mamba2, attention, Mamba2, MLP); 3 "
                                                "groups: 2 Mamba, 1 attention whose block vLLM raises to 64"),
    "falcon_h1": FamilyArgs(NO_PREFIX_CACHING, "FalconH1ForCausalLM, attention and Mamba2 in each of 4 layers; 2 "
                                               "groups: attention (block raised to 64), Mamba"),
    "zamba2": FamilyArgs(NO_PREFIX_CACHING, "Zamba2ForCausalLM, 4 Mamba2 layers, 2 of them with the shared attention "
                                            "block; 3 groups: attention (block 32), 2 Mamba"),
    "granitemoehybrid": FamilyArgs(NO_PREFIX_CACHING, "GraniteMoeHybridForCausalLM, 3 Mamba2 + 1 attention layer; 4 "
                                                      "groups: 3 Mamba, attention (block raised to 64)"),
}
"""Mamba groups' block is the whole ``max_model_len`` (one state per request): vLLM logs e.g. ``kv cache group sizes
(8192, 8192, 64)`` for NemotronH."""


def _common(*, tied: bool = False) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_RANGE,
        "tie_word_embeddings": tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": UNK_ID,
        "dtype": "float32",
    }


def _attention() -> dict[str, Any]:
    return {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": 3 * HIDDEN}


def _gemma(cls_name: str, layer_types: list[str], *, tied: bool = False) -> Any:
    import transformers

    return getattr(transformers, cls_name)(
        **_common(tied=tied), **_attention(), head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
        sliding_window=SLIDING_WINDOW, layer_types=layer_types,
    )


def tiny_config(family: str) -> Any:
    """The transformers config of ``family`` (one of ``FAMILIES``)."""
    import transformers

    sliding, full = "sliding_attention", "full_attention"
    if family == "gemma2":  # attention and final logit softcapping (50, 30) kept: the CPU backend applies them
        return _gemma("Gemma2Config", [sliding, full, sliding, full], tied=True)  # vLLM's Gemma 2 always ties
    if family == "gemma3":
        return _gemma("Gemma3TextConfig", [sliding, sliding, sliding, full])
    if family == "mistral_sliding":
        return transformers.MistralConfig(**_common(), **_attention(), head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW)
    if family == "nemotron_h":
        return transformers.NemotronHConfig(
            **_common(), **_attention(), head_dim=HEAD_DIM,
            layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            mamba_num_heads=MAMBA_HEADS, mamba_head_dim=MAMBA_HEAD_DIM, n_groups=1, ssm_state_size=MAMBA_STATE,
            chunk_size=MAMBA_CHUNK,
        )
    if family == "falcon_h1":
        return transformers.FalconH1Config(
            **_common(), **_attention(), head_dim=HEAD_DIM, mamba_d_ssm=2 * HIDDEN, mamba_n_heads=MAMBA_HEADS,
            mamba_d_head=MAMBA_HEAD_DIM, mamba_n_groups=1, mamba_d_state=MAMBA_STATE, mamba_chunk_size=MAMBA_CHUNK,
        )
    if family == "zamba2":  # attention on 2x hidden: 8 heads of 64, as many KV heads (vLLM needs that); vLLM ties
        return transformers.Zamba2Config(
            **_common(tied=True), layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
            num_attention_heads=8, num_key_value_heads=8, intermediate_size=3 * HIDDEN, n_mamba_heads=MAMBA_HEADS,
            mamba_d_state=MAMBA_STATE, mamba_ngroups=1, chunk_size=MAMBA_CHUNK,
        )
    if family == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            **_common(), **_attention(),
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            position_embedding_type="rope", num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=2 * HIDDEN, mamba_n_heads=MAMBA_HEADS, mamba_d_head=MAMBA_HEAD_DIM,
            mamba_n_groups=1, mamba_d_state=MAMBA_STATE, mamba_chunk_size=MAMBA_CHUNK,
        )
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def build_tiny_model(directory: str | os.PathLike[str], family: str, *, seed: int = 0) -> Path:
    """Write ``family``'s model directory (config, float32 weights from ``seed``, tokenizer) and return its path.

    Idempotent like ``build_tiny_llama``: a complete directory built with the same arguments is left as it is."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    args = {"family": family, "seed": seed, "revision": REVISION}

    def write(staging: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = tiny_config(family)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        if family == "gemma2":
            _scale_gemma2_sublayers(model)
        model.save_pretrained(staging, safe_serialization=True)
        save_tokenizer(staging, VOCAB, MAX_POSITIONS)

    return build_once(Path(directory), args, MARKER, write)


def _scale_gemma2_sublayers(model: Any) -> None:
    """Scale every sublayer's output by 10 (its post-norm scales by ``1 + weight``, 0 at init): with tied embeddings,
    scaled by sqrt(hidden), a random Gemma 2 otherwise echoes its last input token forever."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".post_attention_layernorm." in name or ".post_feedforward_layernorm." in name:
                parameter.fill_(GEMMA2_POST_NORM)
