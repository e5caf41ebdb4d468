"""The lossy levels judged as users judge them: SmolLM2 on held-apart ShareGPT conversations, against exact KV.

For each context (a ShareGPT conversation through the chat template, ``CONTEXT``
tokens, then ``CONTINUATION`` tokens of it) the model computes the context's KV
once; each level encodes it block by block (``tiercache.codecs``, the engine's
float32 KV in blocks of ``BLOCK_TOKENS``) and decodes it, and the model then reads
the continuation teacher-forced on top of the decoded KV. Against the exact KV:

- size, relative to 16-bit KV and to the engine's dtype (float32 on vLLM's CPU build);
- perplexity change of the continuation, mean and worst sample (the largest in magnitude);
- top-1 agreement (the decoded run's most likely token is the exact run's);
- mean KL divergence of the next-token distribution (nats);
- encode and decode speed, raw KV bytes per second on one core (torch and the coder on one thread).

The compact level's tables are learned on ``LEARN`` other conversations
(``tiercache.codecs.tables.learn_tables``) and the judged ones come after them in
the file. Writes ``codec.json`` next to this file (and the tables, ``codec_tables.npz``,
with ``--tables``).

    .venv/bin/python benchmarks/codec.py            # 24 learned, 12 judged: a few minutes on 2 cores
    .venv/bin/python benchmarks/codec.py --quick    # 2 learned, 1 judged, short contexts (figures mean nothing)
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, parse, write_result

from tiercache.blocks.layout import KVLayout, MemoryOrder
from tiercache.codecs.coding import KVCoding
from tiercache.codecs.geometry import KVGeometry
from tiercache.codecs.levels import Level
from tiercache.codecs.tables import learn_tables
from tiercache.testing.real_model import build_smollm2
from tiercache.tools.real_kv import context_kv, load_model, real_contexts

CONTEXT = 896
CONTINUATION = 64
LEARN = 24
JUDGED = 12
BLOCK_TOKENS = 16
ENGINE_DTYPE = "float32"
"""The KV dtype vLLM's CPU build serves SmolLM2 in (``--dtype float32``)."""
SIXTEEN_BIT_BYTES = 2
SPEED_REPEATS = 3
"""Encode and decode runs per level for the speed: the fastest counts (the least disturbed by other work)."""


def continuation_logprobs(model: Any, ids: list[int], kv: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the continuation's tokens, read teacher-forced on top of ``kv`` (the context's K/V)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    heads = model.config.num_key_value_heads
    for layer in range(kv.shape[0]):
        pair = [kv[layer, kind].view(CONTEXT, heads, -1).permute(1, 0, 2)[None].contiguous() for kind in range(2)]
        cache.update(pair[0], pair[1], layer)
    with torch.no_grad():
        out = model(torch.tensor([ids[CONTEXT:]]), past_key_values=cache, use_cache=True)
    return out.logits[0].float().log_softmax(-1)


def blocks_of(kv: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    """The context's KV as the engine's blocks (layer-major, ``layout``'s dtype)."""
    layers, _, tokens, _ = kv.shape
    shaped = kv.view(layers, 2, tokens, layout.num_kv_heads, layout.head_dim).to(layout.torch_dtype)
    return [shaped[:, :, start : start + BLOCK_TOKENS].contiguous() for start in range(0, tokens, BLOCK_TOKENS)]


def as_bytes(block: torch.Tensor) -> memoryview:
    return memoryview(block.view(torch.uint8).numpy()).cast("B")


def coded_kv(coding: KVCoding, level: Level, kv: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, int]:
    """``kv`` through ``level`` block by block (exact: untouched), and the bytes the level stored."""
    if level is Level.EXACT:
        return kv, kv.numel() * layout.itemsize
    geometry = coding.geometry
    decoded, stored = [], 0
    for block in blocks_of(kv, layout):
        payload = coding.encode(level, as_bytes(block))
        stored += len(payload.data)
        out = torch.empty_like(block)
        assert coding.decode_into(payload.coding, memoryview(payload.data), as_bytes(out))
        decoded.append(geometry.values(as_bytes(out)))
    return torch.cat(decoded, dim=2), stored


def speed(coding: KVCoding, level: Level, kv: torch.Tensor, layout: KVLayout) -> dict[str, float]:
    """Raw KV bytes encoded and decoded per second on this thread (the fastest of ``SPEED_REPEATS``)."""
    blocks = blocks_of(kv, layout)
    raw = sum(block.numel() * block.element_size() for block in blocks)
    encode_s = decode_s = math.inf
    for _ in range(SPEED_REPEATS):
        started = time.perf_counter()
        payloads = [coding.encode(level, as_bytes(block)) for block in blocks]
        encode_s = min(encode_s, time.perf_counter() - started)
        out = torch.empty_like(blocks[0])
        started = time.perf_counter()
        for payload in payloads:
            coding.decode_into(payload.coding, memoryview(payload.data), as_bytes(out))
        decode_s = min(decode_s, time.perf_counter() - started)
    return {"encode_mb_per_s": raw / encode_s / 1e6, "decode_mb_per_s": raw / decode_s / 1e6}


def judge(
    model: Any, judged: list[list[int]], exact: list[torch.Tensor], decoded: list[torch.Tensor]
) -> dict[str, Any]:
    """Perplexity change (mean, worst), top-1 agreement and mean KL of ``decoded`` KV against exact."""
    changes, agree, positions, kl = [], 0, 0, 0.0
    for ids, reference, kv in zip(judged, exact, decoded, strict=True):
        logprobs = continuation_logprobs(model, ids, kv)
        targets = torch.tensor(ids[CONTEXT + 1 :])[:, None]
        exact_nll = -reference[:-1].gather(1, targets).mean()
        nll = -logprobs[:-1].gather(1, targets).mean()
        changes.append(math.exp(float(nll - exact_nll)) - 1)
        agree += int((logprobs.argmax(-1) == reference.argmax(-1)).sum())
        positions += logprobs.shape[0]
        kl += float((reference.exp() * (reference - logprobs)).sum())
    return {"perplexity_change_mean": sum(changes) / len(changes), "perplexity_change_worst": max(changes, key=abs),
            "top1_agreement": agree / positions, "mean_kl_nats": kl / positions, "positions": positions}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__ or "")
    parser.add_argument("--learn", type=int, default=LEARN, help="conversations the compact tables are learned on")
    parser.add_argument("--judged", type=int, default=JUDGED, help="held-apart conversations judged")
    parser.add_argument("--tables", type=Path, help="also write the learned tables to this file")
    args = parse(parser, argv, learn=2, judged=1)
    torch.set_num_threads(1)  # per core; also two threads on two busy cores spin far slower than one
    tokenizer, model = load_model(build_smollm2())
    contexts = real_contexts(tokenizer, args.learn + args.judged, CONTEXT + CONTINUATION)
    learned, judged = contexts[: args.learn], contexts[args.learn :]
    tables = learn_tables(context_kv(model, ids[:CONTEXT]) for ids in learned)
    if args.tables:
        tables.save(args.tables)
    exact_kv = [context_kv(model, ids[:CONTEXT]) for ids in judged]
    exact = [continuation_logprobs(model, ids, kv) for ids, kv in zip(judged, exact_kv, strict=True)]
    config = model.config
    heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    layout = KVLayout(config.num_hidden_layers, heads, head_dim, ENGINE_DTYPE, BLOCK_TOKENS, MemoryOrder.LAYER_MAJOR)
    coding = KVCoding(KVGeometry.of(layout), [Level.INT8, Level.COMPACT], tables)
    rows = []
    for level in Level:
        coded = [coded_kv(coding, level, kv, layout) for kv in exact_kv]
        stored = sum(size for _, size in coded)
        values = sum(kv.numel() for kv in exact_kv)
        row = {"level": level.value, "size_vs_16bit": values * SIXTEEN_BIT_BYTES / stored,
               "size_vs_engine_dtype": values * layout.itemsize / stored,
               **judge(model, judged, exact, [kv for kv, _ in coded])}
        if level.lossy:
            row.update(speed(coding, level, exact_kv[0], layout))
        rows.append(row)
    print(f"{'level':8s} {'vs 16-bit':>9s} {'vs fp32':>8s} {'ppl mean':>9s} {'worst':>8s} {'top-1':>7s} "
          f"{'mean KL':>9s} {'enc MB/s':>9s} {'dec MB/s':>9s}")
    for row in rows:
        print(f"{row['level']:8s} {row['size_vs_16bit']:8.2f}x {row['size_vs_engine_dtype']:7.2f}x "
              f"{100 * row['perplexity_change_mean']:+8.2f}% {100 * row['perplexity_change_worst']:+7.2f}% "
              f"{100 * row['top1_agreement']:6.1f}% {row['mean_kl_nats']:9.5f} "
              f"{row.get('encode_mb_per_s', 0):9.0f} {row.get('decode_mb_per_s', 0):9.0f}")
    result = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)", "context_tokens": CONTEXT,
              "continuation_tokens": CONTINUATION, "learned": args.learn, "judged": args.judged,
              "engine_dtype": ENGINE_DTYPE, "block_tokens": BLOCK_TOKENS, "tables_digest": tables.digest.hex(),
              "rows": rows}
    print(f"wrote {write_result(__file__, result, args.out, args.quick)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
