"""PageTokenMap: where each token's K and V of each channel lie in an engine's pages, so a codec can read them.

An engine's pages are bytes to every tier (``PageLayout``). The ``compact``
level needs more: a block as ``[layers, 2, tokens, channels]``. An engine that
knows its attention kernel's page order says so with a map: a block is
``[ranks][layers][heads][region]``, each head's region ``2 * tokens * head_size``
elements, and ``key`` / ``value`` give, for each token and channel of one head
(token-major), that element's offset in the region. A kernel that packs K
(vLLM's CPU kernels store it transposed) is only another pair of offset lists.
The map does not change what any stored value means (a compact value holds the
logical K/V, exact and ``int8`` values the pages), so it is not in the namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiercache.common.fields import FieldError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PageTokenMap:
    """How one block of an engine's pages holds ``ranks * heads`` heads of ``layers`` layers (see the module
    docstring); ``source`` names where the order came from (for logs)."""

    layers: int
    ranks: int
    heads: int
    head_size: int
    tokens: int
    key: tuple[int, ...]
    """Per (token, channel) of one head, token-major: the K element's offset in the head's region."""
    value: tuple[int, ...]
    """The same for V."""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "ranks", "heads", "head_size", "tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise FieldError(name, "a positive integer", value)
        cells = self.tokens * self.head_size
        if len(self.key) != cells or len(self.value) != cells:
            raise FieldError("key", f"{cells} offsets each for K and V (tokens x head_size)",
                             (len(self.key), len(self.value)))
        if sorted(self.key + self.value) != list(range(2 * cells)):
            raise FieldError("key", f"K and V offsets that cover a head's region of {2 * cells} elements once", "")

    @property
    def channels(self) -> int:
        """Channels of a token: every rank's heads x head size (rank-major, as the model's heads)."""
        return self.ranks * self.heads * self.head_size

    @property
    def elements(self) -> int:
        """The elements of one block."""
        return self.ranks * self.layers * self.heads * 2 * self.tokens * self.head_size

    def index(self) -> torch.Tensor:
        """Each element's offset in the block, ``[layers, 2, tokens, channels]`` (int64): the block's values are
        ``block.flatten()[index]``, and a write back is a scatter through it."""
        import torch

        region = 2 * self.tokens * self.head_size
        shape = (self.layers, 2, self.tokens, self.ranks, self.heads, self.head_size)
        inside = torch.tensor([self.key, self.value], dtype=torch.int64).view(1, 2, self.tokens, 1, 1, self.head_size)
        heads = torch.arange(self.heads, dtype=torch.int64).view(1, 1, 1, 1, self.heads, 1) * region
        layers = torch.arange(self.layers, dtype=torch.int64).view(self.layers, 1, 1, 1, 1, 1) * self.heads * region
        ranks = torch.arange(self.ranks, dtype=torch.int64).view(1, 1, 1, self.ranks, 1, 1) * (
            self.layers * self.heads * region)
        where = (inside + heads + layers + ranks).expand(shape)
        return where.reshape(self.layers, 2, self.tokens, self.channels).contiguous()


def interleaved_map(layers: int, ranks: int, heads: int, head_size: int, tokens: int,
                    source: str = "") -> PageTokenMap:
    """The map of pages whose head region is ``[tokens, 2 * head_size]``: each token's K then its V (vLLM's
    ``[blocks, heads, tokens, 2 * head_size]`` logical page of FlashAttention and its kind)."""
    key = tuple(t * 2 * head_size + d for t in range(tokens) for d in range(head_size))
    value = tuple(k + head_size for k in key)
    return PageTokenMap(layers, ranks, heads, head_size, tokens, key, value, source)
