"""A real ``transformers`` model served through tiercache: reused KV continues exactly like the KV it was.

Tiny random-weight Llama and Qwen3 models (float32, one CPU thread, the CPU
standing in for the GPU pool). A first request computes a prompt's prefix and
stores it; the prefix is then made to live only in the tier under test (the GPU
pool, the CPU tier, or — written by one engine, read by a fresh one — Redis, the
file tier, a regional store read through central); a second request reuses it
and prefills only its suffix. Its tokens and every step's logits must equal,
bit for bit, a ``DynamicCache`` run of the same forward calls (``Replay``); and
a cache-less recompute agrees within 1e-5 (there the first pass's and the
decode steps' matrix products differ in shape, so in reduction order).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import numpy as np
import torch
from support.hf_models import (
    ARCHITECTURES,
    BLOCK_SIZE,
    DECODE_STEPS,
    GENERATE,
    MEMORY_ORDERS,
    PREFIX,
    PREFIX_BLOCKS,
    SUFFIX,
    Replay,
    assert_bitwise,
    check,
    evict_gpu,
    expected,
    generate,
    random_tokens,
    reuse,
    store_prefix,
    tiny_config,
    tiny_model,
    topology,
)
from transformers import MambaConfig, MambaForCausalLM

from tiercache import CapacityError, TierManager, UnsupportedModelError
from tiercache.integrations.transformers import CachedModel

HANG_GUARD_S = 300
"""Fail rather than hang if the second process never finishes (not a speed limit: it takes seconds)."""
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("memory", MEMORY_ORDERS)
@pytest.mark.parametrize("source", ["gpu", "cpu"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_local_hit_continues_bitwise(arch: str, source: str, memory: str) -> None:
    model, prompt = tiny_model(arch), random_tokens(PREFIX + SUFFIX, seed=1)
    with TierManager(topology(model, memory)) as manager:
        store_prefix(manager, model, prompt[:, :PREFIX])
        if source == "cpu":
            evict_gpu(manager)
        got = reuse(manager, model, prompt, source)
    check(model, prompt, got)


def through_remote(arch: str, memory: str, first: dict[str, Any], second: dict[str, Any], **load: Any) -> None:
    """Engine A stores the prefix down to a remote; a fresh engine B (empty GPU and CPU) reuses it."""
    model, prompt = tiny_model(arch), random_tokens(PREFIX + SUFFIX, seed=2)
    with TierManager(topology(model, memory, [first])) as engine_a:
        store_prefix(engine_a, model, prompt[:, :PREFIX])
    with TierManager(topology(model, memory, [second])) as engine_b:
        got = reuse(engine_b, model, prompt, second["name"], **load)
    check(model, prompt, got)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_redis_hit_continues_bitwise(arch: str, redis_server: Any) -> None:
    remote = {"name": "redis", "type": "redis", "options": {"url": redis_server.url}}
    through_remote(arch, "block_major", remote, remote)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_file_hit_continues_bitwise(arch: str, tmp_path: Any) -> None:
    remote = {"name": "file", "type": "file", "options": {"path": str(tmp_path / "kv"), "max_blocks": 256}}
    through_remote(arch, "layer_major", remote, remote)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_regional_hit_continues_bitwise(arch: str, redis_factory: Any) -> None:
    """Written through region 1 (replicated to central), read in region 2 with ``force_latest``."""
    central, region_one, region_two = redis_factory(), redis_factory(), redis_factory()

    def regional(region: Any) -> dict[str, Any]:
        options = {"central_url": central.url, "region_url": region.url, "mode": "regional"}
        return {"name": "regional", "type": "regional", "options": options}

    through_remote(arch, "block_major", regional(region_one), regional(region_two), force_latest=True)


def test_one_changed_token_in_block_3_reuses_blocks_0_to_2() -> None:
    model = tiny_model("llama")
    prompt = random_tokens(6 * BLOCK_SIZE + 2, seed=3)
    changed = prompt.clone()
    changed[0, 3 * BLOCK_SIZE + 1] = changed[0, 3 * BLOCK_SIZE + 1] % (model.config.vocab_size - 1) + 1
    with TierManager(topology(model)) as manager:
        cached = CachedModel(model, manager)
        cached.generate(prompt, max_new_tokens=1, do_sample=False)
        turn = cached.generate(changed, DECODE_STEPS, **GENERATE)
    assert turn.reused == {"gpu": 3 * BLOCK_SIZE, "cpu": 0}
    replay = Replay(model)
    replay.prefill(prompt)
    assert_bitwise(replay.turn(changed, 3 * BLOCK_SIZE, DECODE_STEPS), turn.output)


def test_multi_turn_chats_share_a_system_prompt() -> None:
    """Two users, one system prompt, three rounds each, interleaved: each turn reuses all it can.

    Bitwise against the replay only: a prefix's K/V depend (in their last bits) on
    the pass that computed them (a prefill of n tokens, a decode step), which is
    why the reference replays each conversation's own passes.
    """
    model = tiny_model("llama")
    system = random_tokens(3 * BLOCK_SIZE + 1, seed=10)
    histories = {"ann": system, "bob": system}
    replays = {"ann": Replay(model), "bob": Replay(model)}
    with TierManager(topology(model)) as manager:
        cached = CachedModel(model, manager)
        for round_index in range(3):
            for user_index, user in enumerate(histories):
                question = random_tokens(5 + user_index, seed=100 * round_index + user_index)
                prompt = torch.cat([histories[user], question], dim=1)
                shared = system.shape[1] if round_index or user_index else 0
                known = replays[user].cache.get_seq_length() or shared
                turn = cached.generate(prompt, DECODE_STEPS, **GENERATE)
                assert turn.cached_tokens == known // BLOCK_SIZE * BLOCK_SIZE
                assert turn.reused["gpu"] == turn.cached_tokens
                if user_index and not round_index:
                    # bob's first turn reuses the system prompt's blocks as ann's first pass computed them
                    replays[user].cache = copy.deepcopy(replays["ann"].cache)
                assert_bitwise(replays[user].turn(prompt, turn.cached_tokens, DECODE_STEPS), turn.output)
                histories[user] = turn.output.sequences


def test_model_generate_on_the_turns_cache() -> None:
    """``model.generate`` itself on ``turn.cache``: the prefix is skipped, positions continue, KV is stored."""
    model, prompt = tiny_model("qwen3"), random_tokens(PREFIX + SUFFIX, seed=4)
    with TierManager(topology(model)) as manager:
        cached = CachedModel(model, manager)
        store_prefix(manager, model, prompt[:, :PREFIX])
        with cached.begin(prompt, DECODE_STEPS) as turn:
            assert turn.cache.get_seq_length() == PREFIX
            got = generate(model, turn.input_ids, turn.cache, DECODE_STEPS)
            turn.finish(got)
        follow_up = torch.cat([got.sequences, random_tokens(2, seed=5)], dim=1)
        again = cached.generate(follow_up, 1, do_sample=False)
    check(model, prompt, got)
    assert again.cached_tokens == (PREFIX + SUFFIX + DECODE_STEPS - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_prompt_cached_to_its_end_recomputes_its_last_block() -> None:
    model, prompt = tiny_model("llama"), random_tokens(PREFIX, seed=6)
    with TierManager(topology(model)) as manager:
        cached = CachedModel(model, manager)
        cached.generate(prompt, max_new_tokens=1, do_sample=False)
        turn = cached.generate(prompt, DECODE_STEPS, **GENERATE)
    assert turn.cached_tokens == PREFIX - BLOCK_SIZE and turn.computed_tokens == BLOCK_SIZE
    replay = Replay(model)
    replay.prefill(prompt)
    assert_bitwise(replay.turn(prompt, PREFIX - BLOCK_SIZE, DECODE_STEPS), turn.output)


def test_models_whose_cache_is_not_plain_kv_are_refused() -> None:
    state_space = MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2)
    model = MambaForCausalLM(state_space).eval()
    with TierManager(topology(tiny_model("llama"))) as manager:
        with pytest.raises(UnsupportedModelError, match="state-space layers"):
            CachedModel(model, manager)
        with pytest.raises(ValueError, match=r"set layout.num_layers/num_kv_heads/head_dim in the topology"):
            CachedModel(tiny_model("qwen3"), manager)


def test_capacity_error_leaves_nothing_held() -> None:
    """A request that cannot get its blocks holds nothing afterwards: the pool empties fully."""
    model = tiny_model("llama")
    prompt = random_tokens(PREFIX + SUFFIX, seed=7)
    with TierManager(topology(model, gpu_blocks=2 * PREFIX_BLOCKS)) as manager:
        cached = CachedModel(model, manager)
        first = cached.generate(prompt[:, :PREFIX], max_new_tokens=1, do_sample=False)
        first.stored.result()  # its blocks are pinned until their write-through copy lands
        with cached.begin(random_tokens(PREFIX + SUFFIX, seed=8), DECODE_STEPS), pytest.raises(CapacityError):
            cached.begin(prompt, DECODE_STEPS)
        evict_gpu(manager)


def test_tiny_configs_differ_in_head_dim() -> None:
    """The second architecture really sets ``head_dim`` apart from hidden / heads."""
    qwen = tiny_config("qwen3")
    assert qwen.head_dim != qwen.hidden_size // qwen.num_attention_heads


SECOND_PROCESS = """
import json, sys
import numpy as np, torch
from support.hf_models import random_tokens, tiny_model, topology
from tiercache import TierManager
from tiercache.integrations.transformers import CachedModel

url, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
model = tiny_model("llama")
remote = {"name": "redis", "type": "redis", "options": {"url": url}}
with TierManager(topology(model, "layer_major", [remote])) as manager:
    turn = CachedModel(model, manager).generate(
        random_tokens(%(tokens)d, seed=%(seed)d), %(steps)d, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )
np.save(out, torch.stack(turn.output.logits).numpy())
print(json.dumps({"reused": turn.reused, "sequences": turn.output.sequences.tolist()}))
"""


def test_second_process_reuses_kv_through_redis(redis_server: Any, tmp_path: Any) -> None:
    """This process stores a prefix into Redis; a fresh Python process loads it and continues bitwise."""
    model, prompt = tiny_model("llama"), random_tokens(PREFIX + SUFFIX, seed=9)
    remote = {"name": "redis", "type": "redis", "options": {"url": redis_server.url}}
    with TierManager(topology(model, "layer_major", [remote])) as manager:
        store_prefix(manager, model, prompt[:, :PREFIX])
    script = SECOND_PROCESS % {"tokens": PREFIX + SUFFIX, "seed": 9, "steps": DECODE_STEPS}
    logits_file = tmp_path / "logits.npy"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", script, redis_server.url, str(logits_file)],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["reused"] == {"gpu": 0, "cpu": 0, "redis": PREFIX}
    want = expected(model, prompt)
    assert report["sequences"] == want.sequences.tolist()
    assert torch.equal(torch.from_numpy(np.load(logits_file, allow_pickle=False)), torch.stack(want.logits))
