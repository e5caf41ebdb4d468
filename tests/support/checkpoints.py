"""Checkpoint directories on disk, as an engine finds them: ``config.json`` and safetensors weights.

The identity tests of every adapter use them to roll out a fine-tune over the same path, put two models in
directories of one name, or copy one elsewhere. The weights are random tensors of a tiny Llama's names
and shapes; engines that read no weights in a test only see their digest change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "vocab_size": 512, "max_position_embeddings": 1024, "torch_dtype": "float32",
}
"""A tiny Llama's ``config.json`` (the connector and tier tests' vLLM reads it; no weights are loaded)."""


def weights(seed: int, config: dict = CONFIG) -> dict[str, torch.Tensor]:
    """Random float32 weights named and shaped as ``config``'s Llama keeps them."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        attention = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                     "o_proj": (hidden, hidden)}
        mlp = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
        shapes |= {f"{prefix}.self_attn.{name}.weight": shape for name, shape in attention.items()}
        shapes |= {f"{prefix}.mlp.{name}.weight": shape for name, shape in mlp.items()}
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_checkpoint(directory: Path, seed: int, config: dict = CONFIG) -> Path:
    """``config.json`` and ``model.safetensors`` of ``weights(seed)`` in ``directory``, over what is there."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return write_weights(directory, seed, config)


def write_weights(directory: Path, seed: int, config: dict = CONFIG) -> Path:
    """``model.safetensors`` of ``weights(seed)`` in ``directory`` (a fine-tune saved over the same path)."""
    save_file(weights(seed, config), directory / "model.safetensors")
    return directory


def copy_checkpoint(directory: Path, to: Path) -> Path:
    """The checkpoint copied to ``to`` (a copy's files are new: other times, other inode)."""
    return Path(shutil.copytree(directory, to))
