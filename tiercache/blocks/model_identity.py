"""ModelIdentity: when two engines' KV for the same token ids is interchangeable, one rule for every adapter.

The rule (docs/architecture.md, "Which model's KV"): two models share KV exactly
when their architecture config (every field that decides K/V, with the engine's
own overrides and quantization), their compute dtype and their weights agree.
The weights are named by a digest of their content, never by a name or a path:
a fine-tune saved over the same directory gets a new identity, two checkpoints
in directories of one name stay apart, and a checkpoint copied elsewhere (or
loaded again) shares. The digest samples every tensor (its name, dtype, shape
and ``SAMPLE_WINDOWS`` windows of its bytes, the whole tensor when smaller), so
a multi-GB checkpoint costs a few MB of reads, hashed with XXH3 (the digest
names weights and guards no secret; the identity itself is BLAKE2b). A change
that spares every sampled window of every tensor is not seen (training changes
all of a tensor it touches). The tokenizer is not part of it: keys hash token ids, and the KV of an
id sequence depends on the weights and config alone.

Where an engine hands over only a name that no local checkpoint answers to (not
a directory, not in the Hugging Face cache), the name and revision stand in for
the weights (``ModelIdentity.weights_named``): adapters log it, and the user
must then give weights of their own a name of their own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import xxhash

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IDENTITY_BYTES = 16
"""Bytes of the identity's digest: as long as a block key."""
SAMPLE_WINDOWS = 16
"""Windows of bytes hashed per tensor (evenly spaced, the first and last included)."""
WINDOW_BYTES = 4096
"""Bytes per window: one page, so a window costs one read of a file."""
FILE_WINDOWS = 1024
"""Windows hashed per weight file whose tensors cannot be told apart (pickled ``.bin``, ``.pt``, GGUF)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
"""Files of a checkpoint directory that hold weights."""
SAFETENSORS_HEADER = struct.Struct("<Q")
"""A safetensors file starts with its JSON header's length."""
CONFIG_FILE = "config.json"
"""A checkpoint's architecture config."""
NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache",
})
"""Config fields that never change the K/V of given ids (names, versions, output flags; the dtype is its own part)."""
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
"""torch's dtype names as safetensors writes them, so a file's digest and its tensors' in memory agree."""
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""An object's address in its ``repr``: differs per process, so it is cut from a config before hashing."""


@dataclass(frozen=True)
class ModelIdentity:
    """What must match for two models' KV of the same token ids to be interchangeable."""

    config_digest: str
    weights: str
    """``checkpoint:<digest>`` or ``tensors:<digest>`` (content), or ``name:<name>@<revision>`` (nothing to read)."""
    dtype: str

    @property
    def weights_named(self) -> bool:
        """Whether only a name stands for the weights (an update in place under that name is not seen)."""
        return self.weights.startswith("name:")

    @property
    def digest(self) -> bytes:
        """The identity as ``IDENTITY_BYTES`` bytes (BLAKE2b of its parts)."""
        text = "\x1f".join(("tiercache-model-v1", self.config_digest, self.weights, self.dtype))
        return hashlib.blake2b(text.encode(), digest_size=IDENTITY_BYTES).digest()

    @property
    def model_id(self) -> str:
        """The namespace's model id (``Namespace.model_id``): the digest in hex."""
        return "model-" + self.digest.hex()


def config_digest(config: Mapping[str, Any]) -> str:
    """A digest of the fields of ``config`` that decide K/V (``NOT_ARCHITECTURE`` left out, at any depth)."""
    text = json.dumps(_architecture(config), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(ADDRESS.sub("", text).encode(), digest_size=IDENTITY_BYTES).hexdigest()


def _architecture(value: Any) -> Any:
    """``value`` without the ``NOT_ARCHITECTURE`` keys of its mappings (a VLM's text config nests them)."""
    if isinstance(value, Mapping):
        return {str(key): _architecture(item) for key, item in value.items() if key not in NOT_ARCHITECTURE}
    if isinstance(value, list | tuple):
        return [_architecture(item) for item in value]
    return value


def checkpoint_identity(
    model: str | os.PathLike[str],
    dtype: str,
    *,
    config: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> ModelIdentity:
    """The identity of the checkpoint ``model`` names (a directory, a weight file, or a Hugging Face id found in
    the local cache).

    ``config``: the architecture config as the engine runs it; by default the checkpoint's ``config.json``.
    ``settings``: the engine's options that change K/V beyond it (quantization, config overrides; None values
    count as unset). A name no local checkpoint answers to is identified by the name and ``revision``
    (``ModelIdentity.weights_named``).
    """
    directory = find_checkpoint(str(model), revision, cache_dir)
    if directory is None:
        log.warning(
            "tiercache: %r is not a local checkpoint: its KV is identified by that name and revision %r, so "
            "other weights served under one name would share it; serve from a directory to have the weights "
            "digested", str(model), revision,
        )
        weights = f"name:{model}@{revision or '-'}"
    else:
        if config is None:
            path = (directory if directory.is_dir() else directory.parent) / CONFIG_FILE
            config = json.loads(path.read_text()) if path.is_file() else {}
        weights = "checkpoint:" + checkpoint_digest(directory)
    settings = {name: value for name, value in (settings or {}).items() if value is not None}
    return ModelIdentity(config_digest({"config": config or {}, "settings": settings}), weights, str(dtype))


def find_checkpoint(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """Where ``model``'s weights are: itself when a directory or a file (GGUF), else its Hugging Face snapshot."""
    if os.path.exists(model):
        return Path(os.path.realpath(model))
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # not a hub id, or not in the cache: the name alone names the weights
        return None


def checkpoint_digest(checkpoint: str | os.PathLike[str]) -> str:
    """A digest of the weights in a directory (or of one weight file), taken once per process while unchanged."""
    root = Path(os.path.realpath(checkpoint))
    if root.is_file():  # one file (GGUF): its name is the caller's, not part of the weights
        stat = root.stat()
        return _checkpoint_digest(root.parent, ((root.name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
                                                 stat.st_ino),), named=False)
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.name.endswith(WEIGHT_SUFFIXES) and path.is_file() and not _hidden(relative):
            stat = path.stat()
            files.append((relative.as_posix(), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return _checkpoint_digest(root, tuple(files), named=True)


def _hidden(relative: Path) -> bool:
    """Whether a path lies in a hidden folder (download tools keep their own metadata there)."""
    return any(part.startswith(".") for part in relative.parts[:-1])


@lru_cache(maxsize=16)
def _checkpoint_digest(root: Path, files: tuple[tuple[str, int, int, int, int], ...], named: bool) -> str:
    """The digest of ``files`` (relative name where ``named``, and size; mtime, ctime and inode only key this
    cache, so copies agree)."""
    started = time.perf_counter()
    digest = hashlib.blake2b(digest_size=IDENTITY_BYTES)
    for name, size, *_ in files:
        with (root / name).open("rb", buffering=0) as handle:
            content = safetensors_digest(handle, size) if name.endswith(".safetensors") else _file_digest(handle, size)
        digest.update(f"{name if named else ''}\x1f{size}\x1f{content}\x1f".encode())
    log.info(
        "tiercache: weights of %s digested (%d files, %.2f GB) in %.3f s",
        root, len(files), sum(file[1] for file in files) / 1e9, time.perf_counter() - started,
    )
    return digest.hexdigest()


def safetensors_digest(handle: BinaryIO, size: int) -> str:
    """``tensors_digest`` of a safetensors file's tensors, read from their sampled windows only."""
    (header_bytes,) = SAFETENSORS_HEADER.unpack(handle.read(SAFETENSORS_HEADER.size))
    if header_bytes > size - SAFETENSORS_HEADER.size:
        raise ValueError(f"{handle.name}: not a safetensors file (a header of {header_bytes} bytes in {size})")
    header = json.loads(handle.read(header_bytes))
    data_start = SAFETENSORS_HEADER.size + header_bytes
    digest = xxhash.xxh3_128()
    for name in sorted(key for key in header if key != "__metadata__"):
        entry = header[name]
        begin, end = entry["data_offsets"]
        digest.update(_tensor_label(name, entry["dtype"], entry["shape"]))
        for offset, length in _windows(end - begin, SAMPLE_WINDOWS):
            digest.update(os.pread(handle.fileno(), length, data_start + begin + offset))
    return digest.hexdigest()


def _file_digest(handle: BinaryIO, size: int) -> str:
    """``FILE_WINDOWS`` windows of a weight file whose tensors cannot be told apart without unpickling it."""
    digest = xxhash.xxh3_128()
    for offset, length in _windows(size, FILE_WINDOWS):
        digest.update(os.pread(handle.fileno(), length, offset))
    return digest.hexdigest()


def _tensor_label(name: str, dtype: str, shape: Iterable[int]) -> bytes:
    """What a tensor's digest takes before its bytes: its name, dtype (safetensors' code) and shape."""
    return f"{name}\x1f{dtype}\x1f{json.dumps([int(size) for size in shape])}\x1f".encode()


def _windows(size: int, count: int) -> list[tuple[int, int]]:
    """``count`` windows of ``WINDOW_BYTES`` spread evenly over ``size`` bytes (one window of all, when it fits)."""
    if size <= count * WINDOW_BYTES:
        return [(0, size)]
    last = size - WINDOW_BYTES
    return [(index * last // (count - 1), WINDOW_BYTES) for index in range(count)]


def tensors_identity(
    tensors: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any], dtype: str
) -> ModelIdentity:
    """The identity of weights in memory (a model built from a config, or changed after loading)."""
    return ModelIdentity(config_digest(config), "tensors:" + tensors_digest(tensors), str(dtype))


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Every tensor's name, dtype, shape and sampled bytes, in name order (one copy to the host per tensor)."""
    import torch

    digest = xxhash.xxh3_128()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        if tensor.is_meta:
            raise ValueError(f"{name} has no data here (meta device, offloaded): its weights cannot be digested")
        flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        digest.update(_tensor_label(name, SAFETENSORS_DTYPES.get(dtype, dtype), tensor.shape))
        windows = _windows(flat.numel(), SAMPLE_WINDOWS)
        if len(windows) > 1:
            flat = torch.cat([flat[offset : offset + length] for offset, length in windows])
        digest.update(flat.cpu().numpy().tobytes())
    return digest.hexdigest()
