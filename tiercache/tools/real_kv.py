"""Real KV of a trained chat model on ShareGPT conversations, for the codecs' tests and benchmark.

``real_chats`` renders mostly-ASCII ShareGPT conversations through the chat
template (``tiercache.tools.conversations``) and keeps the first ones long enough
(``training_contexts``: the ones the compact tables learn on by default; a
benchmark judges conversations held ``apart`` from them);
``context_kv`` runs the model over a context and returns its K/V as one tensor
``[layers, 2, tokens, kv_heads * head_dim]`` (float32, K after rotary embedding, as
engines cache it). ``cached_kv`` keeps such tensors in a cache folder, keyed by
the checkpoint's name, the conversations and the lengths, so a test needs the
model only the first time (the tests and ``benchmarks/codec.py`` pass SmolLM2's
checkpoint, ``tiercache.testing.real_model``). Evaluation of a codec against these (teacher-forced perplexity,
top-1 agreement, KL) is ``benchmarks/codec.py``'s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.tools.conversations import ChatSegments, mostly_ascii
from tiercache.tools.sharegpt import read_conversations

TRAINING_CONTEXTS, TRAINING_TOKENS = 24, 896
"""The compact tables' default training set: the first 24 usable conversations, cut to 896 tokens
(``tiercache tables`` and ``benchmarks/codec.py`` learn on the same ones)."""


@dataclass(frozen=True)
class RealContext:
    """A ShareGPT conversation's id and its first tokens through the chat template."""

    conversation: str
    ids: list[int]


def real_chats(tokenizer: Any, count: int, tokens: int, *, skip: int = 0,
               apart: Collection[str] = ()) -> list[RealContext]:
    """The first ``count`` conversations (after ``skip`` usable ones, none of those ``apart`` names) rendered to at
    least ``tokens`` token ids, each cut to exactly ``tokens``."""
    segments = ChatSegments(tokenizer)
    found: list[RealContext] = []
    usable = 0
    for conversation in read_conversations():
        if conversation.id in apart or not mostly_ascii(conversation):
            continue
        ids = list(segments.system)
        for exchange in conversation.exchanges:
            ids += segments.question(exchange.question) + segments.answer(exchange.answer)
            if len(ids) >= tokens:
                break
        if len(ids) < tokens:
            continue
        usable += 1
        if usable > skip:
            found.append(RealContext(conversation.id, ids[:tokens]))
        if len(found) == count:
            return found
    raise ValueError(f"only {len(found)} conversations reach {tokens} tokens")


def real_contexts(tokenizer: Any, count: int, tokens: int, skip: int = 0) -> list[list[int]]:
    """``real_chats``' token ids alone."""
    return [context.ids for context in real_chats(tokenizer, count, tokens, skip=skip)]


def training_contexts(tokenizer: Any, count: int = TRAINING_CONTEXTS, tokens: int = TRAINING_TOKENS,
                      skip: int = 0) -> list[RealContext]:
    """What the compact tables learn on by default (``TRAINING_CONTEXTS``)."""
    return real_chats(tokenizer, count, tokens, skip=skip)


def context_kv(model: Any, ids: list[int]) -> Any:
    """The model's K/V over ``ids``: ``[layers, 2, tokens, kv_heads * head_dim]`` float32."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    layers = []
    for layer in out.past_key_values.layers:
        pair = [tensor[0].permute(1, 0, 2).reshape(len(ids), -1) for tensor in (layer.keys, layer.values)]
        layers.append(torch.stack(pair))
    return torch.stack(layers).float().contiguous()


def load_model(directory: Path) -> tuple[Any, Any]:
    """The tokenizer and float32 model of a checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32
    ).eval()


def cached_kv(directory: Path, cache: Path, count: int, tokens: int, skip: int = 0) -> list[Any]:
    """``context_kv`` of ``real_contexts(count, tokens, skip)`` with the checkpoint in ``directory``, computed once
    and kept in ``cache`` (a name keyed by the checkpoint directory's name, which names its weights)."""
    import torch

    args = {"model": directory.name, "count": count, "tokens": tokens, "skip": skip}
    name = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"{name}.pt"
    if path.exists():
        return list(torch.load(path))
    tokenizer, model = load_model(directory)
    samples = [context_kv(model, ids) for ids in real_contexts(tokenizer, count, tokens, skip)]
    cache.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{id(samples)}.tmp")
    torch.save(samples, staging)
    staging.rename(path)
    return samples
