"""``CachedModel.generate`` past one greedy sequence on an LRU pool: what it reports, and beam search.

* With a GPU policy other than LRU, a prompt's GPU blocks can follow a block
  that only a lower tier holds; ``load`` copies them on the device. Every reused
  token must be counted in the tier the lookup said serves it.
* Beam search (and several sequences per prompt) reuses the cached prefix, stores
  the prompt, and gives what transformers' own beam search gives on the same KV.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from support.hf_models import (
    BLOCK_SIZE,
    DECODE_STEPS,
    GENERATE,
    PREFIX,
    RECOMPUTE_TOLERANCE,
    SUFFIX,
    Replay,
    assert_bitwise,
    random_tokens,
    store_prefix,
    tiny_model,
    topology,
)
from transformers import DynamicCache

from tiercache import TierManager
from tiercache.integrations.transformers import CachedModel, cache_argument

HOLEY_GPU_BLOCKS = 12
"""S3-FIFO evicts by insertion order and hits, not recency: in a 12-block pool this chat's third round finds
a prompt whose third block left the GPU while its fourth stayed (each turn's copies down are waited for, so
the pool's choices do not depend on timing)."""
CHAT_ROUNDS, USERS, OPENING, QUESTION, REPLY = 3, 3, 9, 3, 2
BEAM_SUFFIX = 2 * BLOCK_SIZE + 1
"""Past the stored prefix, a beam request computes two more whole blocks (stored) and its last token."""
BEAMS = {
    "num_beams": 3,
    "num_return_sequences": 2,
    "do_sample": False,
    "output_scores": True,
    "return_dict_in_generate": True,
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lookup_tiers(cached: CachedModel, prompt: torch.Tensor) -> list[str]:
    """Per block the request may reuse, the tier a lookup says serves it (the lookup's pins given back)."""
    hit = cached.manager.lookup(prompt, local_only=True, namespace=cached.namespace)
    cached.manager.release(hit)
    return hit.tiers[: (prompt.shape[1] - 1) // BLOCK_SIZE]


def test_reused_counts_gpu_blocks_after_a_lower_tier_block() -> None:
    """Old code counted the GPU blocks past the leading run in no tier ({'gpu': 8, 'cpu': 4} of 16 tokens)."""
    model = tiny_model("llama")
    holes = 0
    with TierManager(topology(model, gpu_blocks=HOLEY_GPU_BLOCKS, gpu_policy="s3fifo")) as manager:
        cached = CachedModel(model, manager)
        chats = [random_tokens(OPENING, seed=user) for user in range(USERS)]
        replays = [Replay(model) for _ in range(USERS)]
        for round_index in range(CHAT_ROUNDS):
            for user in range(USERS):
                question = random_tokens(QUESTION, seed=100 * round_index + user)
                prompt = torch.cat([chats[user], question], dim=1)
                tiers = lookup_tiers(cached, prompt)
                turn = cached.generate(prompt, REPLY, **GENERATE)
                assert turn.stored is not None
                turn.stored.result()
                assert sum(turn.reused.values()) == turn.cached_tokens, turn.reused
                served = tiers[: turn.cached_tokens // BLOCK_SIZE]
                assert turn.reused == {tier: served.count(tier) * BLOCK_SIZE for tier in ("gpu", "cpu")}
                assert_bitwise(replays[user].turn(prompt, turn.cached_tokens, REPLY), turn.output)
                run = next((index for index, tier in enumerate(served) if tier != "gpu"), len(served))
                holes += "gpu" in served[run:]
                chats[user] = turn.output.sequences
    assert holes, "the chat must leave a GPU block after a CPU one, the case this test is about"


def beams_reference(model: Any, prompt: torch.Tensor, computed_passes: list[int]) -> Any:
    """transformers' beam search on a ``DynamicCache`` filled by the same passes: prefill up to each of
    ``computed_passes`` in turn (the last is the prompt but its last token), one copy per beam."""
    cache = DynamicCache()
    with torch.no_grad():
        for end in computed_passes:
            model(prompt[:, cache.get_seq_length() : end], **cache_argument(model, cache))
    cache.batch_repeat_interleave(BEAMS["num_beams"])
    return model.generate(prompt, **cache_argument(model, cache), max_new_tokens=DECODE_STEPS, **BEAMS)


def assert_same_beams(expected: Any, got: Any) -> None:
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert torch.equal(got.sequences_scores, expected.sequences_scores)
    for want, have in zip(expected.scores, got.scores, strict=True):
        assert torch.equal(want, have)


def test_beam_search_reuses_the_prefix_and_matches_transformers() -> None:
    """Old code: transformers' "`streamer` cannot be used with beam search", a streamer the user never passed."""
    model, prompt = tiny_model("llama"), random_tokens(PREFIX + BEAM_SUFFIX, seed=21)
    with TierManager(topology(model)) as manager:
        store_prefix(manager, model, prompt[:, :PREFIX])
        cached = CachedModel(model, manager)
        turn = cached.generate(prompt, DECODE_STEPS, **BEAMS)
        assert turn.reused == {"gpu": PREFIX, "cpu": 0} and turn.ttft_s is None
        assert turn.output.sequences.shape[0] == BEAMS["num_return_sequences"]
        assert turn.stored is not None
        turn.stored.result()
        assert len(lookup_tiers(cached, prompt)) == PREFIX // BLOCK_SIZE + 2, "the prompt's new blocks are stored"
    assert_same_beams(beams_reference(model, prompt, [PREFIX, PREFIX + BEAM_SUFFIX - 1]), turn.output)
    plain = model.generate(prompt, max_new_tokens=DECODE_STEPS, **BEAMS)
    assert turn.output.sequences.tolist() == plain.sequences.tolist()
    torch.testing.assert_close(turn.output.sequences_scores, plain.sequences_scores, rtol=0, atol=RECOMPUTE_TOLERANCE)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_beam_search_on_an_empty_cache_stores_its_prompt_for_the_next_request(arch: str) -> None:
    """A full-attention and a sliding-window model: the beams match transformers', the prompt is reused next."""
    model, prompt = tiny_model(arch), random_tokens(PREFIX + SUFFIX, seed=22)
    with TierManager(topology(model)) as manager:
        cached = CachedModel(model, manager)
        first = cached.generate(prompt, DECODE_STEPS, **BEAMS)
        assert first.cached_tokens == 0
        follow_up = torch.cat([prompt, random_tokens(2, seed=23)], dim=1)
        second = cached.generate(follow_up, DECODE_STEPS, **GENERATE)
    assert_same_beams(beams_reference(model, prompt, [PREFIX + SUFFIX - 1]), first.output)
    reused = (PREFIX + SUFFIX - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.cached_tokens == reused
    replay = Replay(model)
    replay.prefill(prompt[:, :-1])
    assert_bitwise(replay.turn(follow_up, reused, DECODE_STEPS), second.output)
