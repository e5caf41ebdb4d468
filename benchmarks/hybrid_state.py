"""A hybrid model's prefix reused with its state: time to first token against recomputing, and what saving costs.

For three random-weight hybrid families (gated delta net, Mamba-2, Falcon-H1's
parallel layers; built from configs, nothing downloaded), float32 on the CPU,
one torch thread, ``CachedModel`` over a GPU pool (on the CPU) and a CPU tier:

* ``recompute_ms``: plain ``model.generate`` of one token on the model's own
  cache, the whole prompt prefilled (what a request costs without tiercache);
* ``miss_ms``: the first request through tiercache, which prefills in chunks
  stopping at each anchor and saves the state there; ``chunked_ms``: the same
  chunks on the model's own cache, nothing saved, so ``miss_vs_chunked`` is the
  price of saving (the reference kernels here run a long prompt faster in
  chunks than whole, so ``miss_vs_recompute`` can be below 1);
* ``hit_gpu_ms`` / ``hit_cpu_ms``: the same prompt again, its prefix and state
  restored from the pool, or loaded from the CPU tier;
* ``floor_ms``: the ceiling a restore can reach, measured in the same run: the
  prompt's tail prefilled from a state already in memory (``hit_vs_floor``);
* ``state_bytes``, ``kv_block_bytes``, ``state_pages``: what one saved state
  takes beside the K/V of a block; ``max_logit_diff``: the restored request's
  logits against the recompute's (float32 rounding only).

Run ``python benchmarks/hybrid_state.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch
from common import arguments, parse, write_result
from transformers import AutoModelForCausalLM, DynamicCache

from tiercache import KVLayout, TierManager
from tiercache.config import config_from_dict
from tiercache.integrations.transformers import CachedModel, cache_argument
from tiercache.integrations.transformers.driver import DEFAULT_STATE_EVERY_BLOCKS

FAMILIES = {
    "qwen3_next (gated delta net)": ("Qwen3NextConfig", {
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256}),
    "nemotron_h (mamba-2)": ("NemotronHConfig", {
        "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32, "n_groups": 1}),
    "falcon_h1 (attention + mamba-2 per layer)": ("FalconH1Config", {
        "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 32, "mamba_n_groups": 1, "mamba_d_ssm": 256}),
}
BLOCK_SIZE = 16
COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 32, "vocab_size": 4096, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}


def config_of(family: str, layers: int) -> Any:
    import transformers

    name, fields = FAMILIES[family]
    extra: dict[str, Any] = {}
    if name == "Qwen3NextConfig":
        extra["layer_types"] = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (
            layers // 4)
    elif name == "NemotronHConfig":
        extra["hybrid_override_pattern"] = "MMM*" * (layers // 4)
    config = getattr(transformers, name)(**COMMON, **fields, num_hidden_layers=layers, **extra)
    config._attn_implementation = "eager"
    return config


def topology(config: Any) -> Any:
    layout = KVLayout.from_hf_config(config, block_size=BLOCK_SIZE, with_state=True)
    fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
    tiers = [{"name": "gpu", "type": "gpu", "capacity_blocks": 2048, "options": {"device": "cpu"}},
             {"name": "cpu", "type": "cpu", "capacity_blocks": 4096, "write_policy": "write_through"}]
    return config_from_dict({"model": {"id": "bench-hybrid"}, "layout": {f: getattr(layout, f) for f in fields},
                             "tiers": tiers}, environ={})


def timed(run: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = run()
    return (time.perf_counter() - started) * 1000, value


def chunked(model: Any, config: Any, prompt: torch.Tensor, greedy: dict[str, Any]) -> Any:
    """The prompt prefilled where ``CachedModel`` stops (each anchor, the last block boundary), then one token."""
    cache, tokens = DynamicCache(config=config), prompt.shape[1]
    last = (tokens - 1) // BLOCK_SIZE
    stops = [b for b in range(1, last + 1) if b % DEFAULT_STATE_EVERY_BLOCKS == 0 or b == last]
    for stop in stops:
        model(prompt[:, cache.get_seq_length() : stop * BLOCK_SIZE], **cache_argument(model, cache))
    return model.generate(prompt, **cache_argument(model, cache), **greedy)


def one_run(family: str, layers: int, tokens: int, seed: int) -> dict[str, Any]:
    """One prompt of ``tokens``: recompute, miss, restored hits and the floor, on fresh managers."""
    config = config_of(family, layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(1, COMMON["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(seed))
    greedy = {"max_new_tokens": 1, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        recompute_ms, plain = timed(lambda: model.generate(prompt, **greedy))
        reused = (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        live = DynamicCache(config=config)
        model(prompt[:, :reused], **cache_argument(model, live))
        floor_ms, _ = timed(lambda: model.generate(prompt, **cache_argument(model, live), **greedy))
        chunked_ms, _ = timed(lambda: chunked(model, config, prompt, greedy))
    row: dict[str, Any] = {"recompute_ms": recompute_ms, "floor_ms": floor_ms, "chunked_ms": chunked_ms}
    with TierManager(topology(config)) as manager:
        cached = CachedModel(model, manager)
        row["miss_ms"], first = timed(lambda: cached.generate(prompt, **greedy))
        first.stored.result()
        row["hit_gpu_ms"], hit = timed(lambda: cached.generate(prompt, **greedy))
        manager.release(manager.allocate(manager.gpu.num_blocks))  # the pool emptied: the prefix in the CPU tier
        row["hit_cpu_ms"], from_cpu = timed(lambda: cached.generate(prompt, **greedy))
        state = cached.states.state
        row.update(reused_tokens=hit.cached_tokens, reused_from_cpu=from_cpu.reused["cpu"],
                   states_saved=len(first.state.saved), state_bytes=state.payload_bytes,
                   state_pages=state.pages, kv_block_bytes=manager.layout.bytes_per_block,
                   max_logit_diff=float((hit.output.logits[0] - plain.logits[0]).abs().max()),
                   same_token=bool(hit.output.sequences.tolist() == plain.sequences.tolist()))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__ or "")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parse(parser, argv, tokens=[64], layers=4, runs=1)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows = []
    for family in FAMILIES:
        for tokens in args.tokens:
            runs = [one_run(family, args.layers, tokens, seed) for seed in range(args.runs)]
            medians = {key: statistics.median(run[key] for run in runs)
                       for key in ("recompute_ms", "floor_ms", "chunked_ms", "miss_ms", "hit_gpu_ms", "hit_cpu_ms")}
            row = {"family": family, "prompt_tokens": tokens, **{k: v for k, v in runs[0].items() if k not in medians},
                   **medians, "hit_gpu_ms_runs": [run["hit_gpu_ms"] for run in runs],
                   "max_logit_diff": max(run["max_logit_diff"] for run in runs),
                   "same_token": all(run["same_token"] for run in runs)}
            row["miss_vs_recompute"] = row["miss_ms"] / row["recompute_ms"]
            row["miss_vs_chunked"] = row["miss_ms"] / row["chunked_ms"]
            row["hit_vs_recompute"] = row["hit_gpu_ms"] / row["recompute_ms"]
            row["hit_vs_floor"] = row["hit_gpu_ms"] / row["floor_ms"]
            rows.append(row)
            print(f"{family:42} {tokens:5} recompute {row['recompute_ms']:7.1f} ms"
                  f"  miss x{row['miss_vs_recompute']:.2f} (x{row['miss_vs_chunked']:.2f} of chunked)"
                  f"  hit gpu {row['hit_gpu_ms']:6.1f} cpu {row['hit_cpu_ms']:6.1f} (x{row['hit_vs_recompute']:.2f} of"
                  f" recompute, x{row['hit_vs_floor']:.2f} of floor)  state {row['state_bytes']} B ="
                  f" {row['state_pages']} pages  diff {row['max_logit_diff']:.1e}")
    path = write_result(__file__, {"block_size": BLOCK_SIZE, "layers": args.layers, "runs": args.runs,
                                   "rows": rows}, args.out, args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
