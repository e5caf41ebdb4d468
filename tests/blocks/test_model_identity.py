"""ModelIdentity: one rule for "same model", by content, cheap on a large checkpoint.

The sampled digest of a safetensors file is checked against the same tensors read by the safetensors
library itself (an independent reader of the format); a checkpoint's identity follows its weights and
config, never its directory's name or place, and is taken once per process while its files are unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiercache.blocks import model_identity
from tiercache.blocks.model_identity import (
    SAMPLE_WINDOWS,
    WINDOW_BYTES,
    checkpoint_identity,
    config_digest,
    safetensors_digest,
    tensors_digest,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "rope_theta": 10000.0, "num_hidden_layers": 2}
LARGE = SAMPLE_WINDOWS * WINDOW_BYTES  # bytes past which a tensor is sampled, not read whole


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes, some small (read whole), some large (sampled)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 256, generator=generator),  # 512 KiB: sampled
        "layers.0.q.weight": torch.randn(64, 64, generator=generator).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(64, generator=generator).to(torch.float16),
        "layers.1.q.weight": torch.randn(300, 300, generator=generator),
        "position": torch.arange(100, dtype=torch.int64),
    }


def checkpoint(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A checkpoint directory: ``config.json`` and one safetensors file, written over what is there."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or CONFIG))
    safetensors_torch.save_file(tensors, directory / "model.safetensors")
    return directory


def file_digest(path: Path) -> str:
    with path.open("rb") as handle:
        return safetensors_digest(handle, path.stat().st_size)


def test_a_files_sampled_digest_is_that_of_its_tensors_read_by_the_safetensors_library(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "m", weights(0)) / "model.safetensors"
    assert any(t.numel() * t.element_size() > LARGE for t in weights(0).values())
    assert file_digest(path) == tensors_digest(safetensors_torch.load_file(path).items())
    assert file_digest(path) == tensors_digest(weights(0).items())
    assert file_digest(path) != tensors_digest(weights(1).items())


EMBED_BYTES = 512 * 256 * 4
FOURTH_WINDOW = 3 * (EMBED_BYTES - WINDOW_BYTES) // (SAMPLE_WINDOWS - 1)  # evenly spaced, first and last included


@pytest.mark.parametrize("element", [0, -1, FOURTH_WINDOW // 4 + 1], ids=["first", "last", "a-middle-window"])
def test_a_change_where_a_window_lies_changes_the_digest(tmp_path: Path, element: int) -> None:
    tensors = weights(0)
    before = tensors_digest(tensors.items())
    tensors["embed.weight"].view(-1)[element] += 1.0
    assert tensors_digest(tensors.items()) != before
    assert file_digest(checkpoint(tmp_path / "m", tensors) / "model.safetensors") != before


def test_a_change_between_windows_is_not_read(tmp_path: Path) -> None:
    """The price of reading a few KB per tensor, as documented: training changes every window of a tensor."""
    tensors = weights(0)
    before = tensors_digest(tensors.items())
    tensors["embed.weight"].view(-1)[(FOURTH_WINDOW + WINDOW_BYTES + 64) // 4] += 1.0
    assert tensors_digest(tensors.items()) == before


def test_name_dtype_and_shape_count_even_for_the_same_bytes() -> None:
    tensor = torch.arange(64, dtype=torch.int32)
    one = tensors_digest([("a", tensor)])
    assert tensors_digest([("b", tensor)]) != one
    assert tensors_digest([("a", tensor.view(torch.float32))]) != one
    assert tensors_digest([("a", tensor.view(8, 8))]) != one
    assert tensors_digest([("a", tensor.clone())]) == one


def test_a_copy_elsewhere_shares_and_an_update_in_place_does_not(tmp_path: Path) -> None:
    original = checkpoint(tmp_path / "a" / "model", weights(0))
    copy = Path(shutil.copytree(original, tmp_path / "elsewhere" / "renamed"))
    same_name = checkpoint(tmp_path / "b" / "model", weights(1))
    first = checkpoint_identity(original, "float32")
    assert checkpoint_identity(copy, "float32") == first
    assert checkpoint_identity(same_name, "float32") != first
    checkpoint(original, weights(2))  # a fine-tune saved over the same directory, same config
    updated = checkpoint_identity(original, "float32")
    assert updated != first and updated.config_digest == first.config_digest
    assert checkpoint_identity(original, "bfloat16") != updated


def test_the_digest_is_taken_once_per_process_while_the_files_are_unchanged(tmp_path: Path) -> None:
    directory = checkpoint(tmp_path / "m", weights(0))
    model_identity._checkpoint_digest.cache_clear()
    first = checkpoint_identity(directory, "float32")
    assert checkpoint_identity(directory, "float32") == first
    assert model_identity._checkpoint_digest.cache_info().misses == 1
    assert model_identity._checkpoint_digest.cache_info().hits == 1
    script = (
        "from tiercache.blocks.model_identity import checkpoint_identity\n"
        f"print(checkpoint_identity({str(directory)!r}, 'float32').model_id)"
    )
    other_process = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    assert other_process.stdout.strip() == first.model_id


def test_config_fields_that_decide_kv_count_and_the_others_do_not() -> None:
    base = config_digest(CONFIG)
    assert config_digest({**CONFIG, "transformers_version": "9.9", "_name_or_path": "/x", "use_cache": False}) == base
    assert config_digest({**CONFIG, "rope_theta": 500000.0}) != base
    nested = {"text_config": CONFIG, "architectures": ["Vlm"]}
    assert config_digest({**nested, "text_config": {**CONFIG, "_name_or_path": "/y"}}) == config_digest(nested)
    assert config_digest({**nested, "text_config": {**CONFIG, "hidden_size": 128}}) != config_digest(nested)


def test_engine_settings_count(tmp_path: Path) -> None:
    directory = checkpoint(tmp_path / "m", weights(0))
    plain = checkpoint_identity(directory, "bfloat16")
    assert checkpoint_identity(directory, "bfloat16", settings={"quantization": None}) == plain
    assert checkpoint_identity(directory, "bfloat16", settings={"quantization": "fp8"}) != plain
    assert checkpoint_identity(directory, "bfloat16", config={**CONFIG, "rope_theta": 1.0}) != plain


def test_other_weight_files_are_sampled_across_their_length(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIG))
    payload = bytearray(os.urandom(8 << 20))
    (directory / "pytorch_model.bin").write_bytes(payload)
    before = checkpoint_identity(directory, "float32")
    middle = len(payload) // 2
    payload[middle : middle + (64 << 10)] = os.urandom(64 << 10)  # a small tensor's worth, mid-file
    (directory / "pytorch_model.bin").write_bytes(payload)
    assert checkpoint_identity(directory, "float32") != before


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path: Path) -> None:
    """The Hugging Face cache's own layout (refs/main -> snapshots/<commit>), read by huggingface_hub."""
    pytest.importorskip("huggingface_hub")
    repo = tmp_path / "hub" / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    checkpoint(repo / "snapshots" / commit, weights(0))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    by_id = checkpoint_identity("acme/tiny", "float32", cache_dir=str(tmp_path / "hub"))
    assert not by_id.weights_named
    assert by_id == checkpoint_identity(checkpoint(tmp_path / "local", weights(0)), "float32")


def test_a_name_that_is_no_checkpoint_stands_for_the_weights(caplog: pytest.LogCaptureFixture) -> None:
    named = checkpoint_identity("served-name-only", "float32")
    assert named.weights_named and "not a local checkpoint" in caplog.text
    assert checkpoint_identity("served-name-only", "float32", revision="v2") != named
    assert checkpoint_identity("another-name", "float32") != named


def test_a_single_weight_file_is_a_checkpoint_whatever_its_name(tmp_path: Path) -> None:
    """vLLM serves a GGUF file by its path: the file's content names it, a renamed copy shares."""
    path = tmp_path / "model-q4.gguf"
    path.write_bytes(os.urandom(1 << 20))
    one = checkpoint_identity(path, "float16")
    assert not one.weights_named
    assert checkpoint_identity(shutil.copy(path, tmp_path / "copy.gguf"), "float16") == one
    path.write_bytes(os.urandom(1 << 20))
    assert checkpoint_identity(path, "float16") != one
