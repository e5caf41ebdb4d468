"""``CachedModel.generate`` past one greedy sequence on an LRU pool: what it reports.

* With a GPU policy other than LRU, a prompt's GPU blocks can follow a block
  that only a lower tier holds; ``load`` copies them on the device. Every reused
  token must be counted in the tier the lookup said serves it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from hf_models import (
    BLOCK_SIZE,
    GENERATE,
    Replay,
    assert_bitwise,
    random_tokens,
    tiny_model,
    topology,
)

from tiercache import TierManager
from tiercache.integrations.transformers import CachedModel

HOLEY_GPU_BLOCKS = 12
"""S3-FIFO evicts by insertion order and hits, not recency: in a 12-block pool this chat's third round finds
a prompt whose third block left the GPU while its fourth stayed (each turn's copies down are waited for, so
the pool's choices do not depend on timing)."""
CHAT_ROUNDS, USERS, OPENING, QUESTION, REPLY = 3, 3, 9, 3, 2
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lookup_tiers(cached: CachedModel, prompt: torch.Tensor) -> list[str]:
    """Per block the request may reuse, the tier a lookup says serves it (the lookup's pins given back)."""
    probe = cached.manager.lookup(prompt, cached.key_extra(), local_only=True)
    cached.manager.release(probe)
    return probe.tiers[: (prompt.shape[1] - 1) // BLOCK_SIZE]


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
