"""The lossy levels judged where chats go: SmolLM2 on held-apart ShareGPT conversations, by context band and dtype.

For each band (``BANDS``: 1k, 2k and 4k tokens of context, within the model's
limit) the judged contexts are the first ``--judged`` ShareGPT conversations,
held apart from the tables' training set, that reach the band plus
``CONTINUATION`` tokens through the chat template; a long conversation is judged
in every band it reaches (each band is drawn the same way, and excluding long
ones from the short bands would leave those only chats that stop short). In each
dtype (``DTYPES``: float32 as vLLM's CPU build keeps KV, bfloat16 as GPUs do, the
model itself run in that dtype) the model computes the context's KV in one
forward; each level encodes it block by block (``tiercache.codecs``, blocks of
``BLOCK_TOKENS`` in that dtype) and decodes it, and the model reads the
continuation teacher-forced on top of the decoded KV. Against the exact KV:

- size, relative to 16-bit KV and to the dtype's own;
- perplexity change of the continuation, mean and worst conversation (largest in magnitude, named);
- top-1 agreement (the decoded run's most likely token is the exact run's);
- mean KL divergence of the next-token distribution (nats), and the worst conversation's;
- encode and decode speed once (float32, first band), raw KV bytes per second on one core.

The floor: the same scoring on exact KV computed another valid way, the context
prefilled in two chunks (its first third, then the rest on top of that cache;
halves of 4096 tokens gave bit-identical KV, the kernels' tiles aligned). It is
what the dtype's arithmetic alone changes; its rows count the conversations whose
floor KV came out bit-identical all the same (``identical_kv``). A bfloat16 lossy row is
judged against its band's floor (``judged``): top-1 agreement divided by the
floor's, mean KL minus the floor's, the worst conversation's perplexity change
(magnitude) minus the floor's worst; a float32 row is judged raw (its floor is
far below every target, and is reported). ``TARGETS`` are reported, not asserted.

The compact tables are learned on ``tiercache.tools.real_kv.training_contexts``
(the first ``--learn`` conversations, float32 KV): what ``tiercache tables``
learns by default for this model. Writes ``codec.json`` next to this file (and
the tables, ``codec_tables.npz``, with ``--tables``).

    .venv/bin/python benchmarks/codec.py            # 24 learned, 16 judged a band: ~23 minutes on 2 cores
    .venv/bin/python benchmarks/codec.py --quick    # 2 learned, 1 judged, tiny bands (figures mean nothing)
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
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
from tiercache.tools.real_kv import (
    TRAINING_CONTEXTS,
    RealContext,
    context_kv,
    load_model,
    real_chats,
    training_contexts,
)

BANDS = (1024, 2048, 4096)
"""Context tokens of the judged bands (about 1k, 2k and 4k; cut to the model's limit less the continuation)."""
QUICK_BANDS = (32, 64)
"""``--quick``'s bands: a smoke run."""
CONTINUATION = 64
"""Tokens read teacher-forced after the context."""
JUDGED = 16
"""Conversations judged per band, 1024 positions (at 512, a 99% agreement's sampling error, 0.4%, was as large as
the margins judged)."""
DTYPES = ("float32", "bfloat16")
"""The KV dtypes judged (the model runs in each)."""
BLOCK_TOKENS = 16
"""Tokens per engine block, the unit each level codes."""
SIXTEEN_BIT_BYTES = 2
"""Bytes of a value of 16-bit KV, the size the levels are compared against."""
SPEED_REPEATS = 3
"""Encode and decode runs per level for the speed: the fastest counts (the least disturbed by other work)."""
FLOOR_SPLIT = 3
"""The floor's first chunk is the context's first 1/FLOOR_SPLIT (off the power-of-two tiles of the kernels)."""
FLOOR = "floor"
"""The level name of the floor rows: exact KV prefilled in two chunks."""
SHORT = {"size_vs_16bit": "size", "top1_agreement": "top1", "mean_kl_nats": "kl", "perplexity_change_worst": "ppl"}
"""The table's short names of the targets."""
RAW_JUDGED = "float32"
"""The dtype whose rows are judged raw (its floor is reported beside them)."""


@dataclass(frozen=True)
class Targets:
    """The issue's targets for a lossy level (``worst_ppl``: the worst conversation's perplexity change magnitude)."""

    size_vs_16bit: float
    top1: float
    kl: float
    worst_ppl: float | None = None


TARGETS = {Level.INT8: Targets(1.9, 0.99, 5e-4), Level.COMPACT: Targets(3.0, 0.975, 0.005, 0.03)}
"""int8: >= 1.9x of 16-bit, top-1 >= 99%, KL <= 5e-4; compact: >= 3x, top-1 >= 97.5%, KL <= 0.005, worst ppl <= 3%."""


@dataclass(frozen=True)
class Sample:
    """One conversation's continuation on one level's KV against the exact KV."""

    conversation: str
    perplexity_change: float
    agree: int
    positions: int
    kl_sum: float
    stored: int
    values: int
    identical: bool = False
    """Whether the KV scored was bit-identical to the exact KV."""

    @property
    def kl(self) -> float:
        return self.kl_sum / self.positions


def as_cache(model: Any, kv: torch.Tensor) -> Any:
    """``kv`` (``[layers, 2, tokens, channels]``) as the model's cache, in the model's dtype."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    heads, tokens = model.config.num_key_value_heads, kv.shape[2]
    for layer in range(kv.shape[0]):
        pair = [kv[layer, kind].view(tokens, heads, -1).permute(1, 0, 2)[None].to(model.dtype).contiguous()
                for kind in range(2)]
        cache.update(pair[0], pair[1], layer)
    return cache


def continuation_logprobs(model: Any, continuation: list[int], kv: torch.Tensor) -> torch.Tensor:
    """Log-probabilities after each continuation token, read teacher-forced on top of ``kv`` (the context's K/V)."""
    with torch.no_grad():
        out = model(torch.tensor([continuation]), past_key_values=as_cache(model, kv), use_cache=True)
    return out.logits[0].float().log_softmax(-1)


def chunked_kv(model: Any, ids: list[int]) -> torch.Tensor:
    """The floor's exact KV: ``ids``' first 1/``FLOOR_SPLIT`` prefilled, then the rest on top of its cache
    (``context_kv``'s shape, float32)."""
    split = len(ids) // FLOOR_SPLIT
    with torch.no_grad():
        first = model(torch.tensor([ids[:split]]), use_cache=True)
        out = model(torch.tensor([ids[split:]]), past_key_values=first.past_key_values, use_cache=True)
    layers = []
    for layer in out.past_key_values.layers:
        pair = [tensor[0].permute(1, 0, 2).reshape(len(ids), -1) for tensor in (layer.keys, layer.values)]
        layers.append(torch.stack(pair))
    return torch.stack(layers).float().contiguous()


def blocks_of(kv: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    """The context's KV as the engine's blocks (layer-major, ``layout``'s dtype)."""
    layers, _, tokens, _ = kv.shape
    shaped = kv.view(layers, 2, tokens, layout.num_kv_heads, layout.head_dim).to(layout.torch_dtype)
    return [shaped[:, :, start : start + BLOCK_TOKENS].contiguous() for start in range(0, tokens, BLOCK_TOKENS)]


def as_bytes(block: torch.Tensor) -> memoryview:
    return memoryview(block.view(torch.uint8).numpy()).cast("B")


def coded_kv(coding: KVCoding, level: Level, kv: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, int]:
    """``kv`` through ``level`` block by block, and the bytes the level stored."""
    decoded, stored = [], 0
    for block in blocks_of(kv, layout):
        payload = coding.encode(level, as_bytes(block))
        stored += len(payload.data)
        out = torch.empty_like(block)
        assert coding.decode_into(payload.coding, memoryview(payload.data), as_bytes(out))
        decoded.append(coding.geometry.values(as_bytes(out)))
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


def score(conversation: str, continuation: list[int], reference: torch.Tensor, logprobs: torch.Tensor,
          stored: int, values: int, identical: bool = False) -> Sample:
    """``logprobs`` against ``reference`` (the exact KV's) on one conversation's continuation."""
    targets = torch.tensor(continuation[1:])[:, None]
    exact_nll = -reference[:-1].gather(1, targets).mean()
    nll = -logprobs[:-1].gather(1, targets).mean()
    return Sample(conversation, math.exp(float(nll - exact_nll)) - 1,
                  int((logprobs.argmax(-1) == reference.argmax(-1)).sum()), logprobs.shape[0],
                  float((reference.exp() * (reference - logprobs)).sum()), stored, values, identical)


def judge_context(model: Any, coding: KVCoding, layout: KVLayout, context: RealContext,
                  tokens: int) -> tuple[dict[str, Sample], torch.Tensor]:
    """Every level's and the floor's sample on one context of ``tokens``, and its exact KV."""
    ids, continuation = context.ids[:tokens], context.ids[tokens:]
    exact = context_kv(model, ids)
    reference = continuation_logprobs(model, continuation, exact)
    values = exact.numel()
    exact_bytes = values * layout.itemsize
    floor = chunked_kv(model, ids)
    samples = {Level.EXACT.value: score(context.conversation, continuation, reference, reference, exact_bytes,
                                        values, True),
               FLOOR: score(context.conversation, continuation, reference,
                            continuation_logprobs(model, continuation, floor), exact_bytes, values,
                            torch.equal(floor, exact))}
    for level in TARGETS:
        kv, stored = coded_kv(coding, level, exact, layout)
        samples[level.value] = score(context.conversation, continuation, reference,
                                     continuation_logprobs(model, continuation, kv), stored, values)
    return samples, exact


def summary(samples: list[Sample], itemsize: int) -> dict[str, Any]:
    """One row's figures over a band's conversations."""
    values, stored = sum(s.values for s in samples), sum(s.stored for s in samples)
    positions = sum(s.positions for s in samples)
    worst = max(samples, key=lambda s: abs(s.perplexity_change))
    worst_kl = max(samples, key=lambda s: s.kl)
    return {"conversations": len(samples), "size_vs_16bit": values * SIXTEEN_BIT_BYTES / stored,
            "size_vs_engine_dtype": values * itemsize / stored,
            "perplexity_change_mean": sum(s.perplexity_change for s in samples) / len(samples),
            "perplexity_change_worst": worst.perplexity_change, "worst_conversation": worst.conversation,
            "top1_agreement": sum(s.agree for s in samples) / positions,
            "mean_kl_nats": sum(s.kl_sum for s in samples) / positions,
            "worst_kl_nats": worst_kl.kl, "worst_kl_conversation": worst_kl.conversation, "positions": positions,
            "identical_kv": sum(s.identical for s in samples)}


def verdict(row: dict[str, Any], floor: dict[str, Any], level: Level, dtype: str) -> dict[str, Any]:
    """The figures a lossy row is judged on (raw, or against its band's floor) and each target's pass or fail."""
    target, raw = TARGETS[level], dtype == RAW_JUDGED
    judged = {"against": "exact" if raw else FLOOR,
              "top1_agreement": row["top1_agreement"] / (1 if raw else floor["top1_agreement"]),
              "mean_kl_nats": row["mean_kl_nats"] - (0 if raw else floor["mean_kl_nats"]),
              "perplexity_change_worst_abs": abs(row["perplexity_change_worst"])
              - (0 if raw else abs(floor["perplexity_change_worst"]))}
    passes = {"size_vs_16bit": row["size_vs_16bit"] >= target.size_vs_16bit,
              "top1_agreement": judged["top1_agreement"] >= target.top1,
              "mean_kl_nats": judged["mean_kl_nats"] <= target.kl}
    if target.worst_ppl is not None:
        passes["perplexity_change_worst"] = judged["perplexity_change_worst_abs"] <= target.worst_ppl
    return {"judged": judged, "passes": passes, "meets_targets": all(passes.values())}


def layout_of(model: Any, dtype: str) -> KVLayout:
    """The engine's KV layout for ``model`` in ``dtype``."""
    config = model.config
    heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    return KVLayout(config.num_hidden_layers, heads, head_dim, dtype, BLOCK_TOKENS, MemoryOrder.LAYER_MAJOR)


def show(rows: list[dict[str, Any]]) -> None:
    """The table: one row per band x dtype x level (and the floors)."""
    print(f"{'band':>5s} {'dtype':8s} {'level':8s} {'vs16':>6s} {'ppl mean':>8s} {'worst (conversation)':>24s} "
          f"{'top-1':>6s} {'mean KL':>8s} {'worst KL':>8s} {'judged top-1/KL/worst':>24s} targets")
    for row in rows:
        judged = row.get("judged")
        against = (f"{100 * judged['top1_agreement']:5.1f}% {judged['mean_kl_nats']:8.5f} "
                   f"{100 * judged['perplexity_change_worst_abs']:+5.2f}%" if judged else "")
        passes = row.get("passes")
        marks = " ".join(f"{SHORT[name]}:{'ok' if ok else 'MISS'}" for name, ok in passes.items()) if passes else ""
        print(f"{row['tokens']:5d} {row['dtype']:8s} {row['level']:8s} {row['size_vs_16bit']:5.2f}x "
              f"{100 * row['perplexity_change_mean']:+7.2f}% "
              f"{100 * row['perplexity_change_worst']:+7.2f}% ({row['worst_conversation']:>13s}) "
              f"{100 * row['top1_agreement']:5.1f}% {row['mean_kl_nats']:8.5f} {row['worst_kl_nats']:8.5f} "
              f"{against:>24s} {marks}")


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__ or "")
    parser.add_argument("--learn", type=int, default=TRAINING_CONTEXTS,
                        help="training conversations the compact tables learn on (the default set's first N)")
    parser.add_argument("--judged", type=int, default=JUDGED, help="held-apart conversations judged per band")
    parser.add_argument("--bands", type=int, nargs="+", default=list(BANDS), help="context tokens of each band")
    parser.add_argument("--tables", type=Path, help="also write the learned tables to this file")
    args = parse(parser, argv, learn=2, judged=1, bands=list(QUICK_BANDS))
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # transformers' renaming, not ours
    torch.set_num_threads(1)  # the 2 cores are shared with other work: two threads on busy cores spin far slower
    started, load_start = time.perf_counter(), os.getloadavg()
    tokenizer, model = load_model(build_smollm2())
    limit = model.config.max_position_embeddings - CONTINUATION
    bands = [min(band, limit // BLOCK_TOKENS * BLOCK_TOKENS) for band in args.bands]
    training = training_contexts(tokenizer, args.learn)
    tables = learn_tables(context_kv(model, context.ids) for context in training)
    if args.tables:
        tables.save(args.tables)
    apart = {context.conversation for context in training}
    judged = {band: real_chats(tokenizer, args.judged, band + CONTINUATION, apart=apart) for band in bands}
    models = {dtype: model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
              for dtype in DTYPES}
    rows: list[dict[str, Any]] = []
    speeds: dict[str, dict[str, float]] = {}
    for band in bands:
        for dtype in DTYPES:
            layout = layout_of(model, dtype)
            coding = KVCoding(KVGeometry.of(layout), list(TARGETS), tables)
            per_level: dict[str, list[Sample]] = {}
            for index, context in enumerate(judged[band]):
                samples, exact = judge_context(models[dtype], coding, layout, context, band)
                for name, sample in samples.items():
                    per_level.setdefault(name, []).append(sample)
                if not speeds and index == 0 and dtype == "float32":
                    speeds = {level.value: speed(coding, level, exact, layout) for level in TARGETS}
            floor = summary(per_level[FLOOR], layout.itemsize)
            for name in (Level.EXACT.value, FLOOR, *(level.value for level in TARGETS)):
                row = {"band": band, "tokens": band, "dtype": dtype, "level": name,
                       **summary(per_level[name], layout.itemsize)}
                if name in {level.value for level in TARGETS}:
                    row.update(verdict(row, floor, Level(name), dtype))
                rows.append(row)
            print(f"band {band} {dtype}: {time.perf_counter() - started:.0f} s", flush=True)
    show(rows)
    for level, figures in speeds.items():
        print(f"{level}: encode {figures['encode_mb_per_s']:.0f} MB/s, decode {figures['decode_mb_per_s']:.0f} MB/s "
              f"of float32 KV per core ({bands[0]}-token band)")
    result = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)", "max_position_embeddings":
              model.config.max_position_embeddings, "bands": bands, "dtypes": list(DTYPES),
              "continuation_tokens": CONTINUATION, "learned": args.learn, "judged": args.judged,
              "learned_conversations": sorted(apart),
              "judged_conversations": {str(band): [c.conversation for c in judged[band]] for band in bands},
              "floor": "exact KV of the context prefilled in two chunks (its first third, then the rest on top of "
                       "that cache), scored like a level against the one-forward exact KV",
              "judging": {"float32": "raw, against the exact KV", "bfloat16": "against the band's floor: top-1 "
                          "divided by the floor's, mean KL minus the floor's, worst |perplexity change| minus the "
                          "floor's worst"},
              "targets": {level.value: vars(target) for level, target in TARGETS.items()},
              "block_tokens": BLOCK_TOKENS, "tables_digest": tables.digest.hex(), "speed_float32": speeds,
              "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
              "runtime_s": time.perf_counter() - started, "rows": rows}
    print(f"wrote {write_result(__file__, result, args.out, args.quick)} in {result['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
