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
  ``Turn`` (output, tokens reused per tier, time to first token). Beam search
  and several sequences per prompt run too: the prompt is prefilled on the
  pool and stored, the beams decode on a ``DynamicCache`` transformers can
  reorder (see ``generate``).
* ``with cached.begin(input_ids, max_new_tokens) as turn:`` hands ``turn.cache``
  to the caller's own ``model.generate(...)`` or forward passes;
  ``turn.finish(sequences)`` stores the KV and releases the blocks (leaving the
  block without ``finish`` releases them unstored).

Its keys are in the model's own namespace (the core's one builder,
``engine_namespace``: the model's identity, ``hf_model_identity``: its config,
dtype and a digest of its weights; the topology's page format, rank, tenant and
LoRA), so a different model on the same topology, or the same one updated in
place, never reuses this one's KV.

A hybrid model (state layers beside attention: Qwen3-Next, Nemotron-H,
Falcon-H1, ...) reuses a prefix only with its state, saved and restored beside
the K/V (``tiercache.integrations.transformers.hybrid``); its topology's layout
counts its K/V layers (``KVLayout.from_hf_config(config, with_state=True)``).

It is a synchronous reference driver for one request at a time; an engine's
scheduler interleaves the same calls across requests (see README).
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any

import torch

from tiercache.blocks.keys import Tokens, token_array
from tiercache.blocks.layout import KVLayout
from tiercache.blocks.namespaces import PageFormat, engine_namespace
from tiercache.blocks.paged import PagedKV, blocks_needed
from tiercache.bookkeeping.slots import CapacityError
from tiercache.integrations.transformers.hybrid import StateSaver
from tiercache.integrations.transformers.identity import hf_model_identity
from tiercache.integrations.transformers.paged_cache import PagedCache, cache_argument
from tiercache.integrations.transformers.state import StateFormat, has_state_layers, layer_kinds
from tiercache.integrations.transformers.turn import FirstTokenClock, Turn

if TYPE_CHECKING:
    from tiercache.manager import Lookup, TierManager

__all__ = ["DEFAULT_STATE_EVERY_BLOCKS", "CachedModel"]

DEFAULT_STATE_EVERY_BLOCKS = 16
"""A hybrid model's state is saved at every this many blocks of a prompt (besides its end): a prompt sharing
only a prefix with an earlier one (a system prompt) reuses it up to the last such anchor inside it. A state is
often as large as tens of blocks of K/V, so anchors are sparse."""


class CachedModel:
    """A ``transformers`` causal LM whose requests reuse and feed tiercache's KV."""

    def __init__(
        self,
        model: Any,
        manager: TierManager,
        *,
        lookup_timeout_s: float | None = None,
        state_every_blocks: int = DEFAULT_STATE_EVERY_BLOCKS,
    ) -> None:
        """``manager``'s layout must match the model's KV (see ``KVLayout.from_hf_config``); its pool's
        device must be the model's. ``lookup_timeout_s`` bounds the wait for a pending remote lookup
        (past it the prompt is a miss and is recomputed). The model's identity (``hf_model_identity``) is
        taken now: weights changed later need a new ``CachedModel``. ``state_every_blocks``: a hybrid
        model's anchors (``DEFAULT_STATE_EVERY_BLOCKS``)."""
        layout = manager.layout
        hybrid = has_state_layers(model.config)
        wanted = KVLayout.from_hf_config(model.config, dtype=layout.dtype, block_size=layout.block_size,
                                         with_state=hybrid)
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
        self.identity = hf_model_identity(model)
        topology = manager.config.model
        page_format, state, kinds = layout.page_format(), None, None
        if hybrid:
            _refuse_lossy_tiers(manager)
            kinds = layer_kinds(model.config)
            state = StateFormat.probe(model, layout.bytes_per_block)
            page_format = PageFormat(page_format.engine, {**page_format.fields, "layers": [k for k, _ in kinds],
                                                          "state": state.fields()})
        self.namespace = engine_namespace(self.identity, page_format, topology.tp_rank,
                                          tenant=topology.tenant, lora=topology.lora)
        """The namespace of this model's keys: pass it as ``namespace=`` to call the manager directly."""
        self.states = None if state is None else StateSaver(model, manager, self.namespace, state, kinds,
                                                            state_every_blocks)
        """A hybrid model's state bookkeeping (None for a model of attention layers only)."""

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
        mgr, size, namespace = self.manager, self.manager.block_size, self.namespace
        mgr.poll()  # as an engine's step does: finished transfers handed over, dropped lookups' pins reaped
        if self.states is not None:
            return self._begin_with_state(tokens, max_new_tokens, extra, force_latest, started)
        hit = mgr.lookup_wait(tokens, extra, timeout_s=self.lookup_timeout_s, namespace=namespace)
        usable = min(hit.num_blocks, (len(tokens) - 1) // size)
        on_gpu = min(len(hit.gpu_block_ids), usable)
        try:
            fresh = mgr.allocate(blocks_needed(len(tokens) + max_new_tokens, size) - on_gpu, tokens, extra,
                                 namespace=namespace)
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
            reused=_reused_per_tier(hit, cached // size),
            cached_tokens=cached,
            prepare_s=time.perf_counter() - started,
            extra=extra,
            namespace=namespace,
        )

    def _begin_with_state(self, tokens: Any, max_new_tokens: int, extra: bytes | str | None, force_latest: bool,
                          started: float) -> Turn:
        """``begin`` for a hybrid model: the prefix reused only with its state, the prompt prefilled to its
        last block boundary (``StateSaver.begin``)."""
        state, hit = self.states.begin(self.kv, tokens, max_new_tokens, extra, force_latest, self.lookup_timeout_s)
        cached = state.restored_tokens
        reused = (_reused_per_tier(hit, cached // self.manager.block_size) if hit is not None
                  else dict.fromkeys(self.manager.parts.names, 0))
        return Turn(
            manager=self.manager,
            input_ids=torch.as_tensor(tokens, device=self.model.device)[None],
            block_table=state.table,
            cache=state.cache,
            reused=reused,
            cached_tokens=cached,
            prepare_s=time.perf_counter() - started,
            extra=extra,
            namespace=self.namespace,
            state=state,
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
        With several sequences per prompt (``num_beams`` or ``num_return_sequences`` above 1) the
        prompt but its last token is prefilled on the pool, the sequences decode on a ``DynamicCache``
        holding a copy of it per sequence (transformers reorders beams there), only the prompt's blocks
        are stored, and ``turn.ttft_s`` is None (transformers streams no beams).
        """
        caller_device = input_ids.device if isinstance(input_ids, torch.Tensor) else torch.device("cpu")
        copies = _sequences_per_prompt(self.model, generate_kwargs)
        if copies > 1 and self.states is not None:
            raise ValueError("CachedModel: beam search and several sequences per prompt are not supported for a "
                             "model with state layers (its states would need a copy per sequence)")
        if copies > 1:
            turn = self._generate_sequences(input_ids, max_new_tokens, copies, extra, force_latest, generate_kwargs)
        else:
            clock = FirstTokenClock()
            turn = self.begin(input_ids, max_new_tokens, extra, force_latest)
            with turn:
                turn.output = self.model.generate(
                    turn.input_ids,
                    **cache_argument(self.model, turn.cache),
                    max_new_tokens=max_new_tokens,
                    streamer=clock,
                    **generate_kwargs,
                )
                turn.ttft_s = clock.seconds
                turn.finish(turn.output)
        if isinstance(turn.output, torch.Tensor):
            turn.output = turn.output.to(caller_device)
        return turn

    def _generate_sequences(
        self,
        input_ids: Tokens,
        max_new_tokens: int,
        copies: int,
        extra: bytes | str | None,
        force_latest: bool,
        generate_kwargs: dict[str, Any],
    ) -> Turn:
        """Beam search or several samples: prefill the prompt on the pool, decode ``copies`` rows apart."""
        turn = self.begin(input_ids, 0, extra, force_latest)
        with turn:
            prefilled = turn.prompt_tokens - 1
            if turn.cached_tokens < prefilled:
                with torch.no_grad():
                    self.model(
                        turn.input_ids[:, turn.cached_tokens : prefilled],
                        **cache_argument(self.model, turn.cache),
                        **_last_logits_only(self.model),
                    )
            rows = turn.cache.dense(copies, self.model.dtype)
            turn.output = self.model.generate(
                turn.input_ids, **cache_argument(self.model, rows), max_new_tokens=max_new_tokens, **generate_kwargs
            )
            turn.finish(turn.input_ids)
        return turn


def _refuse_lossy_tiers(manager: TierManager) -> None:
    """A hybrid model's state pages must stay exact: refuse a topology with a tier that reads lossy levels."""
    for tier in manager.config.tiers:
        codec = getattr(tier, "codec", None)
        if codec is not None and codec.lossy:
            raise ValueError(
                f"tier {tier.name!r} stores or reads lossy levels ({[level.value for level in codec.levels]}): a "
                "model with state layers keeps its state beside its KV, which must stay exact; list only the "
                "exact level there"
            )


def _reused_per_tier(hit: Lookup, reused_blocks: int) -> dict[str, int]:
    """Tokens reused per tier, position by position over the blocks the request got (used in place or loaded).

    A GPU block past the leading run (a policy other than LRU can leave one there)
    is copied on the device by ``load`` and counts for the GPU, like the run.
    """
    reused = dict.fromkeys(hit.tier_blocks, 0)
    for tier in hit.tiers[:reused_blocks]:
        reused[tier] += hit.block_size
    return reused


def _sequences_per_prompt(model: Any, generate_kwargs: dict[str, Any]) -> int:
    """The rows ``generate`` expands a prompt to: ``num_beams`` or ``num_return_sequences``, whichever is more."""
    config = generate_kwargs.get("generation_config") or model.generation_config
    beams = generate_kwargs.get("num_beams", config.num_beams) or 1
    sequences = generate_kwargs.get("num_return_sequences", config.num_return_sequences) or 1
    return max(beams, sequences)


def _last_logits_only(model: Any) -> dict[str, int]:
    """``logits_to_keep=1`` where the model's forward takes it (a prefill needs no logits but the last)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
