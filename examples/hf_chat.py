"""A multi-turn chat on a tiny random-weight Llama served through tiercache, turn by turn.

    python examples/hf_chat.py                                   # configs/default.yaml: GPU pool + CPU tier
    python examples/hf_chat.py --redis-url redis://127.0.0.1:6379   # + a Redis tier, then a restarted engine

The model is a ``transformers`` ``LlamaForCausalLM`` built from a config whose
KV shape matches the topology's layout (no download, random weights, token ids
instead of text). Several users share one system prompt and take turns; each
turn's prompt is the conversation so far plus a new question. Per turn the
table shows the prompt's tokens reused from each tier, the tokens computed, the
time to first token through tiercache (lookup, load and the suffix's prefill)
against a recompute of the whole prompt by the same model, and whether both
give the same first token. The GPU pool is shrunk (``--gpu-blocks``) so the
conversations spill into the CPU tier. With ``--redis-url`` the engine is then
restarted (empty GPU and CPU) and every user's next question is served from
Redis. The server must bound its memory (``redis-server --maxmemory 256mb``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from tiercache import TierManager
from tiercache.blocks.layout import KVLayout
from tiercache.config import config_from_dict
from tiercache.integrations.transformers import CachedModel, FirstTokenClock, Turn

REPO = Path(__file__).resolve().parent.parent
VOCAB = 1024
QUERY_HEADS_PER_KV_HEAD = 2
MLP_RATIO = 2
"""The MLP's width as a multiple of the model's."""
SYSTEM_TOKENS = 200
QUESTION_TOKENS = (32, 96)
"""Each question's length is drawn from this range."""
MS = 1000.0


def tiny_llama(layout: KVLayout, seed: int) -> LlamaForCausalLM:
    """A random Llama whose K/V have the layout's shape (grouped-query attention)."""
    heads = QUERY_HEADS_PER_KV_HEAD * layout.num_kv_heads
    hidden = heads * layout.head_dim
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=MLP_RATIO * hidden,
        num_hidden_layers=layout.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def topology(path: str, gpu_blocks: int, redis_url: str | None) -> Any:
    """The YAML topology, with the GPU pool resized and, given a URL, a Redis tier added after the CPU tier."""
    data = yaml.safe_load(Path(path).read_text())
    if gpu_blocks:
        data["tiers"][0]["capacity_blocks"] = gpu_blocks
    if redis_url:
        data["tiers"].append({"name": "redis", "type": "redis", "options": {"url": redis_url}})
    return config_from_dict(data, source=path)


def recompute_ttft(model: LlamaForCausalLM, prompt: torch.Tensor) -> tuple[float, int]:
    """Time to first token, and that token, with no cache at all."""
    clock = FirstTokenClock()
    output = model.generate(prompt, max_new_tokens=1, do_sample=False, streamer=clock)
    return clock.seconds or 0.0, int(output[0, -1])


class Table:
    """Prints one row per turn (tier columns follow the topology) and a total."""

    def __init__(self, tiers: list[str]) -> None:
        self.tiers = tiers
        self.prompt_tokens = self.reused_tokens = 0
        self.saved_s = self.recompute_s = 0.0
        columns = ["turn", "user", "prompt", *tiers, "computed", "ttft ms", "recompute ms", "saved ms", "same 1st"]
        self.widths = [max(len(c), 7) for c in columns]
        print("  ".join(c.rjust(w) for c, w in zip(columns, self.widths, strict=True)))

    def row(self, label: str, user: str, turn: Turn, recompute_s: float, same: bool) -> None:
        ttft = turn.ttft_s or 0.0
        cells = [label, user, turn.prompt_tokens, *(turn.reused.get(t, 0) for t in self.tiers), turn.computed_tokens]
        cells += [f"{ttft * MS:.1f}", f"{recompute_s * MS:.1f}", f"{(recompute_s - ttft) * MS:.1f}"]
        cells.append("yes" if same else "NO")
        print("  ".join(str(c).rjust(w) for c, w in zip(cells, self.widths, strict=True)))
        self.prompt_tokens += turn.prompt_tokens
        self.reused_tokens += turn.cached_tokens
        self.recompute_s += recompute_s
        self.saved_s += recompute_s - ttft

    def total(self) -> None:
        print(
            f"reused {self.reused_tokens} of {self.prompt_tokens} prompt tokens "
            f"({self.reused_tokens / max(self.prompt_tokens, 1):.0%}); time to first token "
            f"{self.saved_s * MS:.0f} ms less than recomputing ({self.saved_s / max(self.recompute_s, 1e-9):.0%})"
        )


def serve(cached: CachedModel, table: Table, label: str, user: str, prompt: torch.Tensor, reply: int) -> torch.Tensor:
    """One turn through tiercache, its row, and the conversation with the reply appended."""
    turn = cached.generate(prompt, max_new_tokens=reply, do_sample=False)
    recompute_s, first = recompute_ttft(cached.model, prompt)
    table.row(label, user, turn, recompute_s, first == int(turn.output[0, prompt.shape[1]]))
    return turn.output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "default.yaml"), help="topology YAML")
    parser.add_argument("--redis-url", help="add a Redis tier at this URL, then restart the engine on it")
    parser.add_argument("--gpu-blocks", type=int, default=36, help="GPU pool size in blocks (0: the YAML's)")
    parser.add_argument("--users", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3, help="turns per user")
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS, help="the shared system prompt's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one gives steady timings)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    config = topology(args.config, args.gpu_blocks, args.redis_url)
    model = tiny_llama(config.layout, args.seed)
    tiers = [tier.name for tier in config.tiers]
    generator = torch.Generator().manual_seed(args.seed)

    def tokens(count: int) -> torch.Tensor:
        return torch.randint(1, VOCAB, (1, count), generator=generator)

    def question() -> torch.Tensor:
        return tokens(int(torch.randint(*QUESTION_TOKENS, (1,), generator=generator)))

    system = tokens(args.system_tokens)
    users = [f"user{index}" for index in range(args.users)]
    chats = dict.fromkeys(users, system)
    print(f"topology {args.config} ({', '.join(tiers)}), GPU pool {config.tiers[0].capacity_blocks} blocks")
    with torch.no_grad(), TierManager(config) as manager:
        model.to(manager.gpu.device)
        recompute_ttft(model, system)  # warm up: the first forward pass of a process is slower
        cached, table = CachedModel(model, manager), Table(tiers)
        for round_index in range(args.turns):
            for user in users:
                prompt = torch.cat([chats[user], question()], dim=1)
                chats[user] = serve(cached, table, str(round_index + 1), user, prompt, args.reply_tokens)
    if args.redis_url:
        with torch.no_grad(), TierManager(config) as restarted:
            print("restarted engine (empty GPU and CPU tiers), same Redis:")
            cached = CachedModel(model, restarted)
            for user in users:
                prompt = torch.cat([chats[user], question()], dim=1)
                serve(cached, table, "restart", user, prompt, args.reply_tokens)
    table.total()
    return 0


if __name__ == "__main__":
    sys.exit(main())
