"""Serving a hybrid model's request: its prefix's state found, restored and saved with the prefix's K/V.

A prefix ending at block ``n`` is reused only with its state after exactly ``n``
blocks (docs/architecture.md, "State beside the KV"). ``StateSaver.begin`` finds
the longest end it can prove whole, K/V and state (the prompt's own end, then
the anchors below it, ``MAX_STATE_TRIES`` lookups at most), loads both in one
``load``, and restores the state only if its pages check out; anything else is
a miss, recomputed. A request then prefills up to the prompt's last block
boundary in chunks that stop at each anchor, saving the state at each stop; its
decode keeps the state at the last block boundary it crosses (a chat's next
turn continues from there), saved by ``finish``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiercache.blocks.paged import blocks_needed
from tiercache.bookkeeping.slots import CapacityError
from tiercache.integrations.transformers.paged_cache import PagedCache, cache_argument
from tiercache.integrations.transformers.state import StateFormat, read_pages, write_pages

if TYPE_CHECKING:
    from tiercache.blocks.keys import Namespace
    from tiercache.manager import Lookup, TierManager

__all__ = ["MAX_STATE_TRIES", "StateSaver", "StateTurn"]

MAX_STATE_TRIES = 4
"""Ends a lookup tries for a whole prefix (K/V and state): the prompt's end, then anchors below it."""


@dataclass(eq=False)
class StateTurn:
    """A hybrid request's state bookkeeping: the ends saved, the state kept at the last decode boundary."""

    saver: StateSaver
    tokens: list[int]
    """The tokens processed so far, as the model's forwards saw them (the prompt, then each decode input)."""
    table: list[int]
    cache: PagedCache
    extra: bytes | str | None
    restored_tokens: int = 0
    """Prompt tokens whose state was restored (0: the prefix was recomputed)."""
    refused_states: int = 0
    """States found but not used: pages that arrived short or did not check out (the request recomputed)."""
    saved: list[int] = field(default_factory=list)
    """Ends (in tokens) whose state this request saved."""
    pending: tuple[int, list[torch.Tensor]] | None = None
    """The state at the last block boundary a forward ended on, not yet saved (a ``StateFormat.snapshot``)."""
    hook: Any = None

    def forwarded(self, input_ids: torch.Tensor) -> None:
        """A forward on this request's cache ran over ``input_ids``: keep its tokens, and the state at a decode's
        block boundary (packed now, saved by ``finish``)."""
        length = self.cache.get_seq_length()
        new = length - len(self.tokens)
        if new > 0:
            self.tokens.extend(input_ids[0, -new:].tolist())
        if length % self.saver.block_size == 0 and length > max(self.saved, default=0):
            self.pending = (length, self.saver.state.snapshot(self.cache))

    def finish(self) -> None:
        """Save the kept state: the last block boundary a forward ended on (after each prefill stop, and before the
        turn's blocks are released)."""
        if self.pending is not None and self.pending[0] not in self.saved:
            self.saver.save(self, *self.pending)
        self.pending = None

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


class StateSaver:
    """Finds, restores and saves a hybrid model's state through one manager (one per ``CachedModel``)."""

    def __init__(self, model: Any, manager: TierManager, namespace: Namespace, state: StateFormat,
                 kinds: list[tuple[str, int]], every_blocks: int) -> None:
        self.model, self.manager, self.namespace, self.state, self.kinds = model, manager, namespace, state, kinds
        self.block_size = manager.block_size
        self.every_blocks = every_blocks

    def begin(self, kv: Any, tokens: Any, max_new_tokens: int, extra: bytes | str | None,
              force_latest: bool, lookup_timeout_s: float | None) -> tuple[StateTurn, Lookup | None]:
        """Allocate and fill one request's blocks and cache: the turn, and the hit it reused (None: a miss)."""
        mgr, size = self.manager, self.block_size
        prompt = tokens  # int64 ids (``token_array``)
        kv_hit = mgr.lookup_wait(prompt, extra, timeout_s=lookup_timeout_s, namespace=self.namespace)
        cap = min(kv_hit.num_blocks, (len(prompt) - 1) // size)
        mgr.release(kv_hit)
        needed = blocks_needed(len(prompt) + max_new_tokens, size)
        end, hit = self._find(prompt, extra, cap, lookup_timeout_s)
        table, restored, refused = None, None, 0
        if hit is not None:
            table, restored = self._load(hit, prompt, extra, end, needed, force_latest)
            refused = int(restored is None)
        if restored is None:
            table, end = mgr.allocate(needed, prompt, extra, namespace=self.namespace), 0
        cache = PagedCache(kv, table, end * size, self.kinds)
        if restored is not None:
            self.state.restore(cache.layers, restored, end * size, self.model.device)
        turn = StateTurn(self, prompt[: end * size].tolist(), table, cache, extra, restored_tokens=end * size,
                         refused_states=refused)
        turn.hook = self.model.register_forward_hook(_hook(turn), with_kwargs=True)
        try:
            self._prefill_to_boundaries(turn, prompt, end)
        except BaseException:
            turn.close()
            mgr.release(table)
            raise
        return turn, (hit if restored is not None else None)

    def _find(self, prompt: np.ndarray, extra: bytes | str | None, cap: int,
              timeout_s: float | None) -> tuple[int, Lookup | None]:
        """The longest end up to ``cap`` blocks whose K/V and state are all held, and its pinned lookup."""
        every = self.every_blocks
        ends = [cap] + [anchor for anchor in range(cap // every * every, 0, -every) if anchor != cap]
        for end in ends[:MAX_STATE_TRIES]:
            if end <= 0:
                break
            chain = self.state.state_tokens(prompt[: end * self.block_size], self.block_size)
            hit = self.manager.lookup_wait(chain, extra, timeout_s=timeout_s, namespace=self.namespace)
            if hit.num_blocks == end + self.state.pages:
                return end, hit
            self.manager.release(hit)
        return 0, None

    def _load(self, hit: Lookup, prompt: np.ndarray, extra: bytes | str | None, end: int, needed: int,
              force_latest: bool) -> tuple[list[int] | None, list[torch.Tensor] | None]:
        """Load a whole hit's K/V into the request's table and its state pages beside: the table and the state
        tensors, or (None, None) with every block handed back when the state does not arrive whole and exact."""
        mgr, size, pages = self.manager, self.block_size, self.state.pages
        run = list(hit.gpu_block_ids)
        on_gpu, state_on_gpu = min(len(run), end), run[end : end + pages]
        try:
            fresh = mgr.allocate(needed - on_gpu + pages - len(state_on_gpu))
        except CapacityError:
            mgr.release(hit)
            raise
        kv_fresh, state_fresh = fresh[: needed - on_gpu], fresh[needed - on_gpu :]
        load_ids = kv_fresh[: end - on_gpu] + state_fresh
        loaded = mgr.load(hit, load_ids, force_latest=force_latest).result() if load_ids else 0
        state_pages = state_on_gpu + state_fresh
        restored = None
        if loaded == len(load_ids) * size:
            restored = self.state.unpack(read_pages(mgr.gpu.tensors, state_pages), end * size)
        if restored is None:
            mgr.release(run[:on_gpu] + fresh + state_on_gpu)
            return None, None
        table = run[:on_gpu] + kv_fresh
        chain = self.state.state_tokens(prompt[: end * size], size)  # indexed again: the pages stay cached here
        mgr.store(chain, table[:end] + state_pages, extra, namespace=self.namespace)
        mgr.release(state_pages)
        return table, restored

    def _prefill_to_boundaries(self, turn: StateTurn, prompt: np.ndarray, start: int) -> None:
        """Prefill the prompt up to its last block boundary, stopping at each anchor, saving the state at each."""
        size, last = self.block_size, (len(prompt) - 1) // self.block_size
        stops = [b for b in range(start + 1, last + 1) if b % self.every_blocks == 0 or b == last]
        ids = torch.as_tensor(prompt, device=self.model.device)[None]
        for stop in stops:
            with torch.no_grad():
                self.model(ids[:, turn.cache.get_seq_length() : stop * size], **cache_argument(self.model, turn.cache))
            turn.finish()  # the forward's hook kept the state at this stop

    def save(self, turn: StateTurn, length: int, snapshot: list[torch.Tensor]) -> None:
        """Store the state ``snapshot`` after ``length`` tokens as its chain over the turn's blocks. Skipped where
        the GPU or CPU tier holds that chain whole already (an earlier request saved it: counted as
        ``states_held``), or where the pool has no room for its pages (``states_skipped``: the prefix is then
        reused only up to an earlier saved end)."""
        mgr, size = self.manager, self.block_size
        chain = self.state.state_tokens(turn.tokens[:length], size)
        held = mgr.lookup(chain, turn.extra, local_only=True, namespace=self.namespace)
        mgr.release(held)
        if held.num_blocks == length // size + self.state.pages:
            mgr.metrics.add("all", "states_held")
            return
        try:
            pages = mgr.allocate(self.state.pages)
        except CapacityError:
            mgr.metrics.add("all", "states_skipped")
            return
        try:
            write_pages(mgr.gpu.tensors, pages, self.state.pack(snapshot, length).to(mgr.gpu.tensors[0].device))
            mgr.store(chain, turn.table[: length // size] + pages, turn.extra, namespace=self.namespace)
            turn.saved.append(length)
        finally:
            mgr.release(pages)


def _hook(turn: StateTurn) -> Any:
    """A forward hook that reports forwards on ``turn``'s cache to it (other caches' forwards are ignored)."""

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is turn.cache:
            input_ids = args[0] if args else kwargs.get("input_ids")
            if input_ids is not None:
                turn.forwarded(input_ids)

    return hook

