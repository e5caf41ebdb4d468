"""Hybrid models (state layers beside attention) reuse a prefix only with its state, restored exactly.

Three tiny random-weight families, each its own kind of state (gated delta net,
Mamba-2, Mamba-2 beside attention in every layer). A first request prefills a
prompt and saves its K/V and, at each anchor and at its last block boundary, the
state layers' state; a second request's prefix is then made to live only in the
tier under test (the GPU pool, the CPU tier, or, written by one engine and read
by a fresh one, Redis and the file tier). The second request must reuse it, and
its tokens and every step's logits must equal, bit for bit, the same forward
calls on the model's own ``DynamicCache`` (``Replay``), and a cache-less
recompute within 1e-5. A state that is missing shortens the hit to the last end
whose state is held; one that does not check out makes the request a miss.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from support.hf_hybrid import (
    BLOCK_SIZE,
    EVERY_BLOCKS,
    FAMILIES,
    GENERATE,
    MORE_FAMILIES,
    Replay,
    assert_bitwise,
    assert_recompute,
    chunk_ends,
    hybrid_config,
    hybrid_model,
    hybrid_topology,
    random_tokens,
)
from transformers import AutoModelForCausalLM, JambaConfig

from tiercache import KVLayout, TierManager, UnsupportedModelError
from tiercache.blocks.namespaces import PageFormat
from tiercache.integrations.transformers import CachedModel
from tiercache.integrations.transformers.state import StateFormat, layer_kinds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = 5 * BLOCK_SIZE + 2
"""The first request's prompt: it stops at the anchors (blocks 2 and 4) and its last boundary (block 5)."""
SUFFIX = 5
DECODE_STEPS = 6


def first_request(manager: TierManager, model: Any, prompt: torch.Tensor) -> None:
    turn = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS).generate(prompt, 1, do_sample=False)
    assert turn.cached_tokens == 0
    assert turn.state.saved == chunk_ends(0, prompt.shape[1])
    turn.stored.result()


def evict_gpu(manager: TierManager) -> None:
    manager.release(manager.allocate(manager.gpu.num_blocks))


def second_request(manager: TierManager, model: Any, prompt: torch.Tensor, source: str) -> Any:
    """Reuses the first request's prompt up to its last boundary, from ``source``; checked bit for bit."""
    turn = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS).generate(prompt, DECODE_STEPS, **GENERATE)
    reused = (PROMPT - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert turn.cached_tokens == reused and turn.reused[source] == reused, turn.reused
    assert turn.state.restored_tokens == reused and turn.state.refused_states == 0
    replay = Replay(model)
    replay.prefill(prompt, chunk_ends(0, PROMPT) + chunk_ends(reused // BLOCK_SIZE, prompt.shape[1]))
    assert_bitwise(replay.generate(prompt, DECODE_STEPS), turn.output)
    assert_recompute(model, prompt, turn.output, DECODE_STEPS)
    return turn


@pytest.mark.parametrize("source", ["gpu", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_local_hit_restores_the_state_bitwise(family: str, source: str) -> None:
    model, prompt = hybrid_model(family), random_tokens(PROMPT + SUFFIX, seed=1)
    with TierManager(hybrid_topology(model)) as manager:
        first_request(manager, model, prompt[:, :PROMPT])
        if source == "cpu":
            evict_gpu(manager)
        second_request(manager, model, prompt, source)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_restore_the_state_bitwise(family: str) -> None:
    """Qwen3.5, Bamba and GraniteMoeHybrid, from the GPU pool: bit for bit against the replay, greedy tokens
    equal to a recompute (Bamba's own chunked scan differs from a whole-prompt pass by ~1e-3 in float32, in
    transformers itself: its logits are judged against the replay only)."""
    model, prompt = hybrid_model(family), random_tokens(PROMPT + SUFFIX, seed=11)
    with TierManager(hybrid_topology(model)) as manager:
        first_request(manager, model, prompt[:, :PROMPT])
        turn = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS).generate(prompt, DECODE_STEPS,
                                                                                    **GENERATE)
    reused = (PROMPT - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert turn.cached_tokens == reused
    replay = Replay(model)
    replay.prefill(prompt, chunk_ends(0, PROMPT) + chunk_ends(reused // BLOCK_SIZE, prompt.shape[1]))
    assert_bitwise(replay.generate(prompt, DECODE_STEPS), turn.output)
    recomputed = model.generate(prompt, max_new_tokens=DECODE_STEPS, **GENERATE)
    assert turn.output.sequences.tolist() == recomputed.sequences.tolist()


def through_remote(family: str, remote: dict[str, Any]) -> None:
    """Engine A saves the prefix down to a remote; a fresh engine B (empty GPU and CPU) restores it."""
    model, prompt = hybrid_model(family), random_tokens(PROMPT + SUFFIX, seed=2)
    with TierManager(hybrid_topology(model, [remote])) as engine_a:
        first_request(engine_a, model, prompt[:, :PROMPT])
    with TierManager(hybrid_topology(model, [remote])) as engine_b:
        second_request(engine_b, model, prompt, remote["name"])


@pytest.mark.parametrize("family", FAMILIES)
def test_redis_hit_restores_the_state_bitwise(family: str, redis_server: Any) -> None:
    through_remote(family, {"name": "redis", "type": "redis", "options": {"url": redis_server.url}})


@pytest.mark.parametrize("family", FAMILIES)
def test_file_hit_restores_the_state_bitwise(family: str, tmp_path: Any) -> None:
    through_remote(family, {"name": "file", "type": "file", "options": {"path": str(tmp_path / "kv"),
                                                                        "max_blocks": 1024}})


def test_a_state_held_already_is_not_saved_again() -> None:
    """The same request twice: the second restores the prompt's last boundary and crosses the decode boundary the
    first saved; that state is held, so it is not packed and stored again (``states_held``)."""
    model, prompt = hybrid_model("qwen3_next"), random_tokens(PROMPT, seed=5)
    with TierManager(hybrid_topology(model)) as manager:
        cached = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS)
        first = cached.generate(prompt, 8, **GENERATE)
        second = cached.generate(prompt, 8, **GENERATE)
        held = manager.stats()["tiers"]["all"]["states_held"]
    assert first.state.saved == [*chunk_ends(0, PROMPT), (PROMPT + 8 - 1) // BLOCK_SIZE * BLOCK_SIZE]
    assert second.cached_tokens == (PROMPT - 1) // BLOCK_SIZE * BLOCK_SIZE and second.state.saved == []
    assert held == 1
    assert torch.equal(second.output.sequences, first.output.sequences)


def test_a_chats_next_turn_continues_from_the_last_decode_boundary() -> None:
    """The reply's last block boundary was crossed in decode: its state is what the next turn restores."""
    model, prompt = hybrid_model("qwen3_next"), random_tokens(PROMPT, seed=3)
    with TierManager(hybrid_topology(model)) as manager:
        cached = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS)
        first = cached.generate(prompt, 8, **GENERATE)
        processed = PROMPT + 8 - 1
        boundary = processed // BLOCK_SIZE * BLOCK_SIZE
        assert first.state.saved[-1] == boundary > (PROMPT - 1) // BLOCK_SIZE * BLOCK_SIZE
        follow_up = torch.cat([first.output.sequences, random_tokens(4, seed=4)], dim=1)
        turn = cached.generate(follow_up, DECODE_STEPS, **GENERATE)
    assert turn.cached_tokens == boundary and turn.reused["gpu"] == boundary
    assert_recompute(model, follow_up, turn.output, DECODE_STEPS)


def shared_prefix_turn(family: str, first_blocks: int, shared_tokens: int, every: int,
                       saved: list[int]) -> tuple[Any, Any, torch.Tensor, int]:
    """A first request of ``first_blocks`` blocks and 2 tokens saves states at ``saved``; a second prompt shares
    its first ``shared_tokens``: the model, the second turn, its prompt and its K/V hit in blocks."""
    model = hybrid_model(family)
    first, other = random_tokens(first_blocks * BLOCK_SIZE + 2, seed=5), random_tokens(6, seed=6)
    with TierManager(hybrid_topology(model)) as manager:
        cached = CachedModel(model, manager, state_every_blocks=every)
        assert cached.generate(first, 1, do_sample=False).state.saved == saved
        prompt = torch.cat([first[:, :shared_tokens], other], dim=1)
        kv_only = manager.lookup(prompt, namespace=cached.namespace)
        manager.release(kv_only)
        turn = cached.generate(prompt, DECODE_STEPS, **GENERATE)
    assert turn.state.refused_states == 0
    assert_recompute(model, prompt, turn.output, DECODE_STEPS)
    return model, turn, prompt, kv_only.num_blocks


def test_a_missing_state_shortens_the_hit_to_the_last_end_whose_state_is_held() -> None:
    """K/V is held for five blocks but a state only at the anchors (blocks 3 and 6): the hit is three blocks."""
    _, turn, _, kv_blocks = shared_prefix_turn("nemotron_h", 7, 5 * BLOCK_SIZE + 1, 3, [12, 24, 28])
    assert kv_blocks == 5 and turn.cached_tokens == 3 * BLOCK_SIZE


def test_without_any_state_held_the_kv_is_never_served_alone() -> None:
    _, turn, prompt, kv_blocks = shared_prefix_turn("falcon_h1", 3, 2 * BLOCK_SIZE + 1, 100, [12])
    assert kv_blocks == 2 and turn.cached_tokens == 0 and turn.computed_tokens == prompt.shape[1]


def test_a_damaged_state_makes_the_request_a_miss() -> None:
    """The state pages in the pool are overwritten: the hit is refused whole, recomputed, and answers right."""
    model, prompt = hybrid_model("qwen3_next"), random_tokens(PROMPT + SUFFIX, seed=9)
    with TierManager(hybrid_topology(model)) as manager:
        cached = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS)
        cached.generate(prompt[:, :PROMPT], 1, do_sample=False)
        end = (PROMPT - 1) // BLOCK_SIZE * BLOCK_SIZE
        chain = cached.states.state.state_tokens(prompt[0, :end].tolist(), BLOCK_SIZE)
        pool = manager.parts.books.local.pool
        keys = manager.parts.hasher_of(cached.namespace).keys(chain)
        first_page = pool.slot_of(keys[-cached.states.state.pages])
        manager.gpu.tensors[0][first_page].view(torch.uint8).flatten()[40:48] ^= 0x5A  # past the header
        turn = cached.generate(prompt, DECODE_STEPS, **GENERATE)
    assert turn.state.refused_states == 1 and turn.cached_tokens == 0
    assert_recompute(model, prompt, turn.output, DECODE_STEPS)


def test_state_pages_that_do_not_check_out_are_refused() -> None:
    model = hybrid_model("falcon_h1")
    with TierManager(hybrid_topology(model)) as manager:
        cached = CachedModel(model, manager)
        state = cached.states.state
        turn = cached.begin(random_tokens(3 * BLOCK_SIZE + 1, seed=10), 1)
        with turn:
            packed = state.pack(turn.cache, 3 * BLOCK_SIZE)
            tensors = state.unpack(packed, 3 * BLOCK_SIZE)
            assert tensors is not None and len(tensors) == len(state.tensors)
            for spec, tensor in zip(state.tensors, tensors, strict=True):
                layer = turn.cache.layers[spec.layer]
                live = (layer.conv_states if spec.kind == "conv" else layer.recurrent_states)[spec.index]
                assert torch.equal(live, tensor)
            assert state.unpack(packed, 2 * BLOCK_SIZE) is None  # the state of another end
            flipped = packed.clone()
            flipped[40] ^= 1
            assert state.unpack(flipped, 3 * BLOCK_SIZE) is None
            assert state.unpack(packed[:16], 3 * BLOCK_SIZE) is None
            other = StateFormat(state.tensors[1:], state.page_bytes)
            assert other.unpack(packed, 3 * BLOCK_SIZE) is None


def test_a_topology_that_reads_lossy_levels_is_refused() -> None:
    model = hybrid_model("qwen3_next")
    remote = {"name": "redis", "type": "redis", "options": {"url": "redis://127.0.0.1:1"},
              "codec": {"levels": ["exact", "int8"]}}
    with (TierManager(hybrid_topology(model, [remote])) as manager,
          pytest.raises(ValueError, match=r"tier 'redis' stores or reads lossy levels")):
        CachedModel(model, manager)


def test_jamba_is_refused_its_chunked_prefill_ignores_the_state() -> None:
    config = JambaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, mamba_d_state=8, attn_layer_period=4,
                         attn_layer_offset=3, expert_layer_period=2, num_experts=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with (TierManager(hybrid_topology(model)) as manager,
          pytest.raises(UnsupportedModelError, match="does not start from the cached state")):
        CachedModel(model, manager)


@pytest.mark.parametrize(("family", "kv_layers"), [("qwen3_next", 1), ("nemotron_h", 1), ("falcon_h1", 2)])
def test_the_layout_counts_kv_layers_and_the_page_format_names_the_state(family: str, kv_layers: int) -> None:
    """A hybrid's pool holds its K/V layers; its keys' page format adds each layer's cache and the state tensors."""
    config = hybrid_config(family)
    with pytest.raises(UnsupportedModelError):
        KVLayout.from_hf_config(config)
    assert KVLayout.from_hf_config(config, block_size=BLOCK_SIZE, with_state=True).num_layers == kv_layers
    model = hybrid_model(family)
    with TierManager(hybrid_topology(model)) as manager:
        cached = CachedModel(model, manager)
        plain = manager.layout.page_format()
        state = cached.states.state
        assert state.tensors and all(tensor.dtype == torch.float32 for tensor in state.tensors)
        named = PageFormat(plain.engine, {**plain.fields, "layers": [kind for kind, _ in layer_kinds(config)],
                                          "state": state.fields()})
        assert cached.namespace.page_format == named.fingerprint() != plain.fingerprint()


def test_a_remote_that_is_down_is_a_miss_and_the_answer_is_right(refused_url: str) -> None:
    model, prompt = hybrid_model("nemotron_h"), random_tokens(PROMPT + SUFFIX, seed=12)
    remote = {"name": "redis", "type": "redis", "options": {"url": refused_url}}
    with TierManager(hybrid_topology(model, [remote])) as engine_a:
        first_request(engine_a, model, prompt[:, :PROMPT])
    with TierManager(hybrid_topology(model, [remote])) as engine_b:
        turn = CachedModel(model, engine_b, state_every_blocks=EVERY_BLOCKS).generate(prompt, DECODE_STEPS,
                                                                                     **GENERATE)
    assert turn.cached_tokens == 0 and turn.state.refused_states == 0
    assert_recompute(model, prompt, turn.output, DECODE_STEPS)


def test_a_pool_without_room_for_a_state_skips_it_and_serves_on() -> None:
    """The request's own blocks fill the pool: its states are skipped (counted), never an exception."""
    model, prompt = hybrid_model("qwen3_next"), random_tokens(PROMPT, seed=13)
    blocks = -(-(PROMPT + DECODE_STEPS) // BLOCK_SIZE)
    with TierManager(hybrid_topology(model, gpu_blocks=blocks)) as manager:
        turn = CachedModel(model, manager, state_every_blocks=EVERY_BLOCKS).generate(prompt, DECODE_STEPS,
                                                                                    **GENERATE)
        skipped = manager.stats()["tiers"]["all"]["states_skipped"]
    assert turn.state.saved == [] and skipped >= len(chunk_ends(0, PROMPT))
    assert_recompute(model, prompt, turn.output, DECODE_STEPS)
