"""A small random-weight Llama model directory built locally from a config (no hub), for engines to serve.

``build_tiny_llama(dir)`` writes what ``vllm serve dir`` (or ``from_pretrained``)
reads: the config, seeded float32 weights (safetensors) and a word-level
tokenizer whose vocabulary is ``<unk> <s> </s> t3 t4 ... t{vocab-1}``, so the
text ``"t17 t4000"`` is the token ids ``[17, 4000]`` (``prompt_text`` writes it).
No BOS is added and generation does not stop at EOS unless it is sampled. The
default shape (hidden 512, 8 layers, 8 query / 2 KV heads, head dim 64, vocab
4096) has about 28M parameters: big enough on a CPU that prefill dominates a
request's time, small enough to build in seconds. Another seed gives another
model of the same shape (the KV of one must never serve the other).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
"""Ids 0, 1, 2; every other id ``i`` is the word ``t{i}``."""
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD_ID = len(SPECIAL_TOKENS)
MARKER = "tiny_llama.json"
"""Written last, with the build's arguments: a directory holding it (with the same arguments) is complete."""


def token_word(token_id: int) -> str:
    """The tokenizer's word for ``token_id``."""
    return SPECIAL_TOKENS[token_id] if token_id < FIRST_WORD_ID else f"t{token_id}"


def prompt_text(token_ids: Iterable[int]) -> str:
    """The text that the tiny tokenizer turns into exactly ``token_ids`` (ids from ``FIRST_WORD_ID`` up)."""
    return " ".join(token_word(int(token_id)) for token_id in token_ids)


def random_prompt_ids(count: int, seed: int, vocab_size: int = 4096) -> list[int]:
    """``count`` token ids in ``FIRST_WORD_ID .. vocab_size-1`` (no special tokens), reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD_ID, vocab_size, (count,), generator=generator).tolist()


def tiny_llama_config(
    *,
    hidden_size: int = 512,
    num_layers: int = 8,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    vocab_size: int = 4096,
    max_position_embeddings: int = 8192,
) -> Any:
    """The ``LlamaConfig`` (MLP width 3x hidden, ``initializer_range=0.1`` so random logits are far from flat)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=UNK_ID,
        dtype="float32",
    )


def save_tokenizer(directory: Path, vocab_size: int, max_length: int) -> None:
    """Save the word-level tokenizer (the word ``t{i}`` is id ``i``) as ``PreTrainedTokenizerFast`` files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token_word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=SPECIAL_TOKENS[UNK_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[UNK_ID],
        model_max_length=max_length,
    ).save_pretrained(directory)


def build_tiny_llama(
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = 512,
    num_layers: int = 8,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    vocab_size: int = 4096,
    max_position_embeddings: int = 8192,
) -> Path:
    """Write the model directory (config, float32 safetensors weights from ``seed``, tokenizer) and return its path.

    Idempotent: a complete directory built with the same arguments is left as it is; anything else there is
    replaced. Built in a sibling temporary directory and renamed into place, so a reader never sees half of one.
    """
    target = Path(directory)
    args = {
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
    }
    def write(staging: Path) -> None:
        from transformers import LlamaForCausalLM

        config = tiny_llama_config(**{name: value for name, value in args.items() if name != "seed"})
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(staging, safe_serialization=True)
        save_tokenizer(staging, vocab_size, max_position_embeddings)

    return build_once(target, args, MARKER, write)


def build_once(target: Path, args: dict[str, Any], marker: str, write: Callable[[Path], None]) -> Path:
    """Have ``write`` fill a sibling staging directory, mark it with ``args`` and rename it to ``target``; a
    ``target`` already marked with the same ``args`` is left as it is (anything else there is replaced)."""
    if _complete(target, args, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0o700 would outlive the rename
        write(staging)
        (staging / marker).write_text(json.dumps(args, sort_keys=True) + "\n")
        if target.exists() and not _complete(target, args, marker):
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:  # another process finished the same build first
            if not _complete(target, args, marker):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _complete(directory: Path, args: dict[str, Any], marker: str) -> bool:
    try:
        return json.loads((directory / marker).read_text()) == args
    except (OSError, ValueError):
        return False
