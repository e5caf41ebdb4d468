"""CachedModel: serve a Hugging Face causal LM's requests through tiercache, the way an engine does.

Per request (a ``Turn``): ``lookup`` (waiting out a pending remote answer) ->
``allocate`` the blocks the request will fill -> ``load`` the lower tiers' part of
the hit -> the model prefills only the uncached suffix, positions continuing
after the cached prefix -> ``store`` the blocks it computed -> ``release``. At
least one prompt token is always computed (the model needs the last position's
logits), so a prompt cached to its end reuses all but its last block.

Two ways to use it:

* ``CachedModel(model, mgr).generate(input_ids, max_new_tokens=...)`` runs
  ``model.generate`` on the request's ``PagedCache`` and returns the finished
  ``Turn`` (output, tokens reused per tier, time to first token).
* ``with cached.begin(input_ids, max_new_tokens) as turn:`` hands ``turn.cache``
  to the caller's own ``model.generate(...)`` or forward passes;
  ``turn.finish(sequences)`` stores the KV and releases the blocks (leaving the
  block without ``finish`` releases them unstored).

It is a synchronous reference driver for one request at a time; an engine's
scheduler interleaves the same calls across requests (see README).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.streamers import BaseStreamer

from tiercache import CapacityError
from tiercache.integrations.transformers.paged_cache import PagedCache
from tiercache.keys import Tokens, token_array
from tiercache.layout import KVLayout
from tiercache.paged import PagedKV, blocks_needed

if TYPE_CHECKING:
    from tiercache import Lookup, TierManager, Transfer

__all__ = ["CachedModel", "FirstTokenClock", "Turn"]

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
    """Prompt tokens whose KV came from each tier, fastest tier first."""
    cached_tokens: int
    prepare_s: float
    """Seconds for lookup, allocate and load."""
    extra: bytes | str | None = None
    stored: Transfer | None = None
    """``store``'s handle once finished: ``stored.result()`` waits until the blocks are indexed and copied down."""
    output: Any = None
    """``model.generate``'s return value (``CachedModel.generate`` only)."""
    ttft_s: float | None = None
    """Seconds from the request's start to its first new token (``CachedModel.generate`` only)."""
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
        self.stored = self.manager.store(processed, self.block_table, self.extra)
        self.close()

    def close(self) -> None:
        """Release the request's blocks (cached ones stay cached); idempotent."""
        if not self.released:
            self.released = True
            self.manager.release(self.block_table)

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class CachedModel:
    """A ``transformers`` causal LM whose requests reuse and feed tiercache's KV."""

    def __init__(self, model: Any, manager: TierManager, *, lookup_timeout_s: float | None = None) -> None:
        """``manager``'s layout must match the model's KV (see ``KVLayout.from_hf_config``); its pool's
        device must be the model's. ``lookup_timeout_s`` bounds the wait for a pending remote lookup
        (past it the prompt is a miss and is recomputed)."""
        layout = manager.layout
        wanted = KVLayout.from_hf_config(model.config, dtype=layout.dtype, block_size=layout.block_size)
        mine = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
        theirs = (wanted.num_layers, wanted.num_kv_heads, wanted.head_dim)
        if mine != theirs:
            raise ValueError(
                f"the topology's layout has (layers, kv heads, head dim) {mine}, the model {theirs}: "
                f"set layout.num_layers/num_kv_heads/head_dim in the topology to {theirs}"
            )
        pool_device = manager.gpu.tensors[0].device
        if torch.device(model.device) != pool_device:
            raise ValueError(f"the model runs on {model.device}, the tiercache pool is on {pool_device}")
        self.model = model
        self.manager = manager
        self.kv = PagedKV(layout, manager.gpu.tensors)
        self.lookup_timeout_s = lookup_timeout_s

    def begin(
        self, input_ids: Tokens, max_new_tokens: int, extra: bytes | str | None = None, force_latest: bool = False
    ) -> Turn:
        """Look up, allocate and load for one request; the returned turn's cache holds the reused prefix.

        ``extra`` is mixed into the keys (see ``TierManager.lookup``); ``force_latest`` is ``load``'s.
        Raises ``CapacityError`` (holding nothing) when the GPU pool cannot fit the request now.
        """
        started = time.perf_counter()
        tokens = token_array(input_ids)
        if len(tokens) == 0:
            raise ValueError("CachedModel.begin: an empty prompt")
        mgr, size = self.manager, self.manager.block_size
        hit = mgr.lookup_wait(tokens, extra, timeout_s=self.lookup_timeout_s)
        usable = min(hit.num_blocks, (len(tokens) - 1) // size)
        on_gpu = min(len(hit.gpu_block_ids), usable)
        try:
            fresh = mgr.allocate(blocks_needed(len(tokens) + max_new_tokens, size) - on_gpu, tokens, extra)
        except CapacityError:
            mgr.release(hit)
            raise
        mgr.release(hit.gpu_block_ids[on_gpu:])
        loaded = mgr.load(hit, fresh[: usable - on_gpu], force_latest=force_latest).result()
        cached = on_gpu * size + loaded
        table = hit.gpu_block_ids[:on_gpu] + fresh
        return Turn(
            manager=mgr,
            input_ids=torch.as_tensor(tokens, device=self.model.device)[None],
            block_table=table,
            cache=PagedCache(self.kv, table, cached),
            reused=_reused_per_tier(hit, on_gpu, loaded // size, size),
            cached_tokens=cached,
            prepare_s=time.perf_counter() - started,
            extra=extra,
        )

    def generate(
        self,
        input_ids: Tokens,
        max_new_tokens: int,
        extra: bytes | str | None = None,
        force_latest: bool = False,
        **generate_kwargs: Any,
    ) -> Turn:
        """Serve one request with ``model.generate`` (other keyword arguments are its own, except ``streamer``).

        Returns the finished turn: ``turn.output`` is what ``generate`` returned, on the device
        ``input_ids`` came on (a CPU prompt gets a CPU output, whatever device the model runs on).
        """
        clock = FirstTokenClock()
        caller_device = input_ids.device if isinstance(input_ids, torch.Tensor) else torch.device("cpu")
        turn = self.begin(input_ids, max_new_tokens, extra, force_latest)
        with turn:
            turn.output = self.model.generate(
                turn.input_ids,
                past_key_values=turn.cache,
                max_new_tokens=max_new_tokens,
                streamer=clock,
                **generate_kwargs,
            )
            turn.ttft_s = clock.seconds
            turn.finish(turn.output)
        if isinstance(turn.output, torch.Tensor):
            turn.output = turn.output.to(caller_device)
        return turn


def _reused_per_tier(hit: Lookup, on_gpu: int, loaded_blocks: int, block_size: int) -> dict[str, int]:
    """Tokens reused per tier: the GPU blocks used, then the loaded ones, fastest lower tier first."""
    reused = {}
    for index, (tier, count) in enumerate(hit.tier_blocks.items()):
        if index == 0:
            taken = on_gpu
        else:
            taken = min(count, loaded_blocks)
            loaded_blocks -= taken
        reused[tier] = taken * block_size
    return reused
