"""A small real transformer whose attention reads and writes K/V in the tiercache pool.

It exists to prove, end to end, that KV loaded from any tier is the KV the model
would have computed: continuing from a loaded prefix must give bitwise the same
logits as recomputing that prefix. It also measures what a prefill costs per
token, which the benchmark's TTFT model compares with each tier's transfer cost.

The architecture is a scaled-down Llama: token embedding, pre-norm blocks of
RMSNorm -> grouped-query attention with rotary positions -> RMSNorm -> SwiGLU
MLP, a final RMSNorm and an output projection. Weights are random from a seeded
generator, so two instances with the same spec are identical. Attention is paged
through ``tiercache.blocks.paged.PagedKV``: a block table maps the sequence's
logical blocks to pool block ids, new tokens'
K/V are written into those blocks (both memory orders of ``KVLayout``) and the
keys and values of all positions so far are gathered back from the pool.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.blocks.layout import KVLayout
from tiercache.blocks.paged import PagedKV

__all__ = ["ModelSpec", "PagedKV", "ReferenceModel", "prefill_seconds_per_token"]

ROPE_THETA = 10_000.0
"""Base of the rotary frequencies (Llama's default)."""
RMS_EPS = 1e-6
INIT_STD = 0.02
"""Standard deviation of the random weights (keeps activations in a sane range)."""
MLP_RATIO = 2
"""MLP hidden width as a multiple of the model width."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the reference model; ``num_layers``, ``num_kv_heads`` and ``head_dim`` must match the layout."""

    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary positions, got {self.head_dim}")

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def for_layout(
        cls, layout: KVLayout, *, heads_per_kv_head: int = 4, vocab_size: int = 512, seed: int = 0
    ) -> ModelSpec:
        """A spec whose K/V fit ``layout`` (grouped-query: ``heads_per_kv_head`` query heads per KV head)."""
        return cls(
            num_layers=layout.num_layers,
            num_heads=layout.num_kv_heads * heads_per_kv_head,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            vocab_size=vocab_size,
            seed=seed,
        )


class ReferenceModel(torch.nn.Module):
    """Llama-style decoder with paged grouped-query attention over a tiercache pool."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.spec = spec
        generator = torch.Generator().manual_seed(spec.seed)

        def weight(*shape: int) -> torch.nn.Parameter:
            values = torch.randn(shape, generator=generator, dtype=torch.float32) * INIT_STD
            return torch.nn.Parameter(values.to(dtype=dtype, device=device), requires_grad=False)

        hidden, mlp = spec.hidden, spec.hidden * MLP_RATIO
        kv_width = spec.num_kv_heads * spec.head_dim
        self.embed = weight(spec.vocab_size, hidden)
        self.layers = torch.nn.ModuleList()
        for _ in range(spec.num_layers):
            layer = torch.nn.Module()
            layer.wq, layer.wk, layer.wv = weight(hidden, hidden), weight(hidden, kv_width), weight(hidden, kv_width)
            layer.wo = weight(hidden, hidden)
            layer.w_gate, layer.w_up, layer.w_down = weight(hidden, mlp), weight(hidden, mlp), weight(mlp, hidden)
            self.layers.append(layer)
        self.head = weight(hidden, spec.vocab_size)
        half = spec.head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / ROPE_THETA ** (torch.arange(half, dtype=torch.float32, device=device) / half)
        )

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions on ``x`` ``[tokens, heads, head_dim]`` (half-split convention)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)

    @torch.no_grad()
    def forward(
        self, tokens: Sequence[int] | torch.Tensor, start: int, block_table: Sequence[int], kv: PagedKV
    ) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` of ``tokens`` at positions ``start``...

        Positions ``0 .. start-1`` are read from the pool blocks in ``block_table``
        (computed earlier or loaded by tiercache); the new tokens' K/V are written
        into the pool first. ``block_table`` must cover every position up to the last.
        """
        spec = self.spec
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=kv.device)
        count = tokens.shape[0]
        end = start + count
        new_positions = torch.arange(start, end, device=kv.device)
        all_positions = torch.arange(end, device=kv.device)
        table = kv.table(block_table)
        causal = all_positions[None, :] <= new_positions[:, None]
        group = spec.num_heads // spec.num_kv_heads
        scale = 1.0 / math.sqrt(spec.head_dim)

        x = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            h = self._norm(x)
            q = (h @ layer.wq).view(count, spec.num_heads, spec.head_dim)
            k = (h @ layer.wk).view(count, spec.num_kv_heads, spec.head_dim)
            v = (h @ layer.wv).view(count, spec.num_kv_heads, spec.head_dim)
            q, k = self._rotate(q, new_positions), self._rotate(k, new_positions)
            kv.write(index, table, start, k, v)
            keys, values = kv.read(index, table, end, dtype=x.dtype)
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
            scores = scores.masked_fill(~causal[None], float("-inf"))
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).reshape(count, spec.hidden)
            x = x + attended @ layer.wo
            h = self._norm(x)
            x = x + (torch.nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down
        return self._norm(x) @ self.head

    @torch.no_grad()
    def generate(
        self, prompt: Sequence[int], start: int, block_table: Sequence[int], kv: PagedKV, steps: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding: feed ``prompt[start:]`` then ``steps`` generated tokens, one at a time.

        Returns the generated tokens and the logits of every forward call, so two
        runs can be compared bitwise.
        """
        logits = self.forward(list(prompt[start:]), start, block_table, kv)
        outputs, history = [], [logits]
        position = len(prompt)
        for _ in range(steps):
            token = int(logits[-1].argmax())
            outputs.append(token)
            logits = self.forward([token], position, block_table, kv)
            history.append(logits)
            position += 1
        return outputs, history


def prefill_seconds_per_token(
    model: ReferenceModel, kv: PagedKV, block_table: Sequence[int], tokens: int, repeats: int = 3
) -> float:
    """Median wall time per token of a ``tokens``-long prefill (the cost a cache hit saves)."""
    prompt = torch.arange(tokens, dtype=torch.long) % model.spec.vocab_size
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.forward(prompt, 0, block_table, kv)
        samples.append((time.perf_counter() - started) / tokens)
    return sorted(samples)[len(samples) // 2]
