"""Turn: one request served through tiercache; FirstTokenClock: its time to first token.

A ``Turn`` holds the request's blocks and ``PagedCache`` from lookup to release:
``finish`` stores the KV the model computed and releases the blocks; leaving it
(``close``, or the ``with`` block) releases them unstored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.streamers import BaseStreamer

from tiercache.blocks.keys import token_array
from tiercache.integrations.transformers.paged_cache import PagedCache

if TYPE_CHECKING:
    from tiercache.blocks.keys import Namespace
    from tiercache.integrations.transformers.hybrid import StateTurn
    from tiercache.manager import TierManager
    from tiercache.movement.transfers import Transfer

__all__ = ["FirstTokenClock", "Turn"]

PROMPT_AND_FIRST_TOKEN = 2
"""``generate`` hands a streamer the prompt first, then each new token: the second call is the first token."""


class FirstTokenClock(BaseStreamer):
    """A ``generate`` streamer that notes when the first new token is out (time to first token)."""

    def __init__(self) -> None:
        """The clock starts now (create it before the request's lookup to count lookup and load)."""
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self._calls = 0

    def put(self, value: torch.Tensor) -> None:
        """Called by ``generate`` with the prompt, then with each new token."""
        self._calls += 1
        if self._calls == PROMPT_AND_FIRST_TOKEN:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""

    @property
    def seconds(self) -> float | None:
        """From the clock's creation to the first new token (None before it)."""
        return None if self.first_token_at is None else self.first_token_at - self.started


@dataclass(eq=False)
class Turn:
    """One request served through tiercache: its blocks, its cache, and what was reused for it."""

    manager: TierManager
    input_ids: torch.Tensor
    """The prompt, ``[1, T]`` on the model's device (pass it to ``model.generate`` whole)."""
    block_table: list[int]
    cache: PagedCache
    reused: dict[str, int]
    """Prompt tokens whose KV came from each tier, fastest tier first (they add up to ``cached_tokens``)."""
    cached_tokens: int
    prepare_s: float
    """Seconds for lookup, allocate and load."""
    extra: bytes | str | None = None
    """The ``extra`` the request's keys were made with."""
    namespace: Namespace | None = None
    """The namespace of the request's keys (``CachedModel``: the model's own; None: the topology's)."""
    stored: Transfer | None = None
    """``store``'s handle once finished: ``stored.result()`` waits until the blocks are indexed and copied down."""
    output: Any = None
    """``model.generate``'s return value (``CachedModel.generate`` only)."""
    ttft_s: float | None = None
    """Seconds from the request's start to its first new token (``CachedModel.generate`` with one sequence only)."""
    state: StateTurn | None = None
    """A hybrid model's state bookkeeping: ends restored and saved (None for attention-only models)."""
    released: bool = field(default=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens."""
        return self.input_ids.shape[1]

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the model prefilled (not reused)."""
        return self.prompt_tokens - self.cached_tokens

    def finish(self, sequences: Any) -> None:
        """Store the KV of the tokens the model has processed (prompt and reply) and release the blocks.

        ``sequences``: ``model.generate``'s output (or its ``sequences``), ``[1, T + new]``.
        """
        if self.released:
            raise RuntimeError("Turn.finish: the turn was already finished or closed")
        tokens = getattr(sequences, "sequences", sequences)
        processed = token_array(tokens)[: self.cache.get_seq_length()]
        self.stored = self.manager.store(processed, self.block_table, self.extra, namespace=self.namespace)
        if self.state is not None:
            self.state.finish()
        self.close()

    def close(self) -> None:
        """Release the request's blocks (cached ones stay cached); idempotent."""
        if not self.released:
            self.released = True
            if self.state is not None:
                self.state.close()
            self.manager.release(self.block_table)

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
