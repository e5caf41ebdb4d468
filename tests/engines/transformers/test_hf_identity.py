"""A model never reuses another model's KV through ``CachedModel``, even when both have one KV shape.

The topology's namespace (``model.id``, layout) cannot tell two models of one
KV shape apart; ``CachedModel`` mixes the model's identity into its keys (the
core's ``ModelIdentity``: config, dtype and a digest of the weights in memory,
never the name or path). Each case below runs two real tiny ``transformers``
models on one manager: the second must reuse nothing of the first's KV and give
its own plain result, bit for bit; the same checkpoint, loaded twice or copied
to another directory, must still share.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from support.hf_models import BLOCK_SIZE, Replay, assert_bitwise, random_tokens, tiny_config, tiny_model, topology
from transformers import LlamaForCausalLM

from tiercache import TierManager
from tiercache.integrations.transformers import CachedModel

PREFIX = 5 * BLOCK_SIZE
SUFFIX = 3
DECODE_STEPS = 4
GENERATE = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def serve_both(first: CachedModel, second: CachedModel, seed: int) -> tuple[Any, Any]:
    """``first`` stores a prompt's prefix; ``second`` then serves the whole prompt. Returns (prompt, turn)."""
    prompt = random_tokens(PREFIX + SUFFIX, seed=seed)
    stored = first.generate(prompt[:, :PREFIX], max_new_tokens=1, do_sample=False).stored
    assert stored is not None and stored.result() == PREFIX
    return prompt, second.generate(prompt, DECODE_STEPS, **GENERATE)


def assert_computed_alone(model: Any, prompt: torch.Tensor, turn: Any) -> None:
    """The turn reused nothing and equals the model's own run from an empty cache, bit for bit."""
    assert turn.cached_tokens == 0, turn.reused
    assert_bitwise(Replay(model).turn(prompt, 0, DECODE_STEPS), turn.output)


def saved(model: Any, path: Path) -> Any:
    """``model`` written as a checkpoint and loaded back (its ``name_or_path`` is then ``path``)."""
    model.save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path).eval()


def test_other_weights_of_one_config_reuse_nothing() -> None:
    """Two models built from one config (no name): the weights tell them apart. Old code: 20 tokens reused."""
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    with TierManager(topology(first)) as manager:
        prompt, turn = serve_both(CachedModel(first, manager), CachedModel(second, manager), seed=1)
    assert_computed_alone(second, prompt, turn)


def test_another_config_of_the_same_kv_shape_reuses_nothing(tmp_path: Path) -> None:
    """Same KV shape, same weights, same path: only ``rope_theta`` differs, so every K differs."""
    base = tiny_config("llama")
    other = tiny_config("llama")
    other.rope_parameters = {**other.rope_parameters, "rope_theta": 500.0}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        first = saved(LlamaForCausalLM(base), tmp_path / "model")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        second = saved(LlamaForCausalLM(other), tmp_path / "model")
    assert first.name_or_path == second.name_or_path
    with TierManager(topology(first)) as manager:
        prompt, turn = serve_both(CachedModel(first, manager), CachedModel(second, manager), seed=2)
    assert_computed_alone(second, prompt, turn)


def test_another_checkpoint_path_reuses_nothing(tmp_path: Path) -> None:
    """Other weights in another directory (same config) are another model."""
    first = saved(tiny_model("llama", seed=0), tmp_path / "a")
    second = saved(tiny_model("llama", seed=1), tmp_path / "b")
    with TierManager(topology(first)) as manager:
        prompt, turn = serve_both(CachedModel(first, manager), CachedModel(second, manager), seed=3)
    assert_computed_alone(second, prompt, turn)


def test_a_checkpoint_updated_in_place_reuses_nothing(tmp_path: Path) -> None:
    """A fine-tune saved over the same path (same config, same ``name_or_path``). Old code: 20 tokens reused."""
    path = tmp_path / "model"
    first = saved(tiny_model("llama", seed=0), path)
    second = saved(tiny_model("llama", seed=1), path)
    assert first.name_or_path == second.name_or_path and first.config.to_dict() == second.config.to_dict()
    with TierManager(topology(first)) as manager:
        prompt, turn = serve_both(CachedModel(first, manager), CachedModel(second, manager), seed=6)
    assert_computed_alone(second, prompt, turn)


def test_models_in_directories_of_one_name_reuse_nothing(tmp_path: Path) -> None:
    first = saved(tiny_model("llama", seed=0), tmp_path / "team-a" / "model")
    second = saved(tiny_model("llama", seed=1), tmp_path / "team-b" / "model")
    with TierManager(topology(first)) as manager:
        prompt, turn = serve_both(CachedModel(first, manager), CachedModel(second, manager), seed=7)
    assert_computed_alone(second, prompt, turn)


def assert_shared(first: Any, second: Any, seed: int) -> None:
    """``second`` reuses the whole prefix ``first`` stored and continues it bit for bit as its own replay."""
    with TierManager(topology(first)) as manager:
        prompt, turn = serve_both(CachedModel(first, manager), CachedModel(second, manager), seed=seed)
    assert turn.cached_tokens == PREFIX
    replay = Replay(second)
    replay.prefill(prompt[:, :PREFIX])
    assert_bitwise(replay.turn(prompt, PREFIX, DECODE_STEPS), turn.output)


def test_one_checkpoint_loaded_twice_shares_its_kv(tmp_path: Path) -> None:
    path = tmp_path / "model"
    first = saved(tiny_model("llama"), path)
    assert_shared(first, LlamaForCausalLM.from_pretrained(path).eval(), seed=4)


def test_a_checkpoint_copied_to_another_directory_shares_its_kv(tmp_path: Path) -> None:
    first = saved(tiny_model("llama"), tmp_path / "model")
    copy = shutil.copytree(tmp_path / "model", tmp_path / "elsewhere" / "copy")
    assert_shared(first, LlamaForCausalLM.from_pretrained(copy).eval(), seed=8)


def test_weights_changed_in_memory_are_another_model(tmp_path: Path) -> None:
    """A fine-tune in this process (one layer changed, same config and ``name_or_path``)."""
    path = tmp_path / "model"
    base = saved(tiny_model("llama"), path)
    tuned = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for parameter in tuned.model.layers[0].self_attn.parameters():
            parameter.mul_(1.5)
    with TierManager(topology(base)) as manager:
        first, second = CachedModel(base, manager), CachedModel(tuned, manager)
        assert first.identity != second.identity
        prompt, turn = serve_both(first, second, seed=5)
    assert_computed_alone(tuned, prompt, turn)


def test_the_identity_is_the_same_for_the_same_model_and_names_what_it_covers() -> None:
    with TierManager(topology(tiny_model("llama"))) as manager:
        one = CachedModel(tiny_model("llama"), manager).identity
        again = CachedModel(tiny_model("llama"), manager).identity
        other = CachedModel(tiny_model("llama", seed=1), manager).identity
    assert one == again != other
    assert one.weights.startswith("tensors:") and one.dtype == "torch.float32" and len(one.digest) == 16
