"""Chained block keys: h_i = H(h_{i-1}, tokens of block i, extra), stable across machines.

The chain makes "longest cached prefix" equal to "first missing key", and the
namespace seed keeps models, layouts, tensor-parallel ranks, tenants and LoRA
adapters apart. BLAKE2b (16-byte digests) is used rather than Python's
``hash()``: it is deterministic everywhere and collision-resistant, so a
crafted prompt cannot alias another tenant's KV.
"""

from __future__ import annotations

import array as array_module
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

KEY_BYTES = 16
_TOKEN_DTYPE = np.dtype("<i8")
MAX_TOKEN_ID = 2**63 - 1
"""Token ids are hashed as little-endian int64: ids run from 0 to this (no vocabulary comes near it)."""

Tokens: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor"
"""A prompt's token ids: a Python list, a numpy array, or a torch tensor (CPU or CUDA), 1-D or ``[1, T]``."""


def token_array(tokens: Tokens) -> np.ndarray:
    """``tokens`` as a 1-D little-endian int64 array, so every input type hashes to the same keys.

    A ``[1, T]`` batch of one (``input_ids`` as tokenizers return it) is flattened;
    arrays and tensors of any integer dtype are widened. Anything that is not an
    integer id in ``[0, 2**63)`` is refused (``TypeError`` for floats, bool arrays
    and tensors and other non-integers, ``ValueError`` for ids out of range), never
    truncated or wrapped, since two prompts that alias would share KV. In a list, a
    Python ``bool`` is the int it is in Python (``True`` is id 1): telling it apart
    would double the cost of a list's conversion. torch is only consulted
    when it is already imported (a torch tensor cannot exist otherwise), so
    hashing stays light.
    """
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(tokens, torch_module.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch_module.bool:
            raise TypeError(f"tokens must be integer ids (any integer dtype), got a tensor of {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        array = _integer_ids(tokens)
    else:
        try:
            # array("q") takes Python and numpy integers only: a float, a str or an id past int64 raises.
            array = np.frombuffer(array_module.array("q", tokens), dtype=_TOKEN_DTYPE)
        except (TypeError, OverflowError):
            array = _integer_ids(np.asarray(tokens))  # [1, T] lists, and the precise error for the rest
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional or [1, T], got shape {array.shape}")
    if len(array) and (lowest := array.item(array.argmin())) < 0:  # argmin and item: a fifth of min()'s cost
        raise ValueError(f"token ids must be in [0, 2**63), got {lowest}")
    return array


def _integer_ids(array: np.ndarray) -> np.ndarray:
    """An integer array as int64, refusing other dtypes and unsigned ids past int64 (negatives: the caller)."""
    if array.dtype == _TOKEN_DTYPE:
        return array
    if array.dtype.kind == "u" and array.dtype.itemsize == _TOKEN_DTYPE.itemsize and array.size:
        if (highest := array.item(array.argmax())) > MAX_TOKEN_ID:
            raise ValueError(f"token ids must be in [0, 2**63), got {highest}")
    elif array.dtype.kind == "O" and array.size and all(type(t) is int for t in array.flat):
        wrong = [t for t in array.flat if not 0 <= t <= MAX_TOKEN_ID]
        if wrong:
            raise ValueError(f"token ids must be in [0, 2**63), got {wrong[0]}")
    elif array.dtype.kind not in "iu" and array.size:
        raise TypeError(f"tokens must be integer ids (any integer dtype), got {array.dtype} values")
    return array.astype(_TOKEN_DTYPE)


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two engines to share a block's KV.

    ``key_id`` is set on a keyed namespace (``tiercache.remote.secret.keyed_namespace``,
    from the namespace's secret): the root, hence every block key, then depends
    on the secret, so engines with different secrets (or none) never address the
    same keys. Without it the root is that of every earlier release.
    """

    model_id: str
    page_format: str
    """The page format's fingerprint (``namespaces.PageFormat.fingerprint``)."""
    tp_rank: int = 0
    tenant_salt: str | None = None
    lora_id: str | None = None
    key_id: bytes = b""

    def root(self) -> bytes:
        """The seed h_{-1} of every chain in this namespace (a BLAKE2b keyed with ``key_id`` when keyed)."""
        fields = (
            "tiercache-v1",
            self.model_id,
            self.page_format,
            str(self.tp_rank),
            self.tenant_salt or "",
            self.lora_id or "",
        )
        encoded = b"\x1f".join(f.encode() for f in fields)
        return hashlib.blake2b(encoded, digest_size=KEY_BYTES, key=self.key_id).digest()


class BlockHasher:
    """Turns a token sequence into the chained keys of its full blocks."""

    def __init__(self, namespace: Namespace, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.namespace = namespace
        self.block_size = block_size
        self._root = namespace.root()
        self._last: tuple[bytes, bytes, bytes, tuple[bytes, ...]] = (b"", b"", b"", ())
        """The last call's whole blocks of token bytes, salt, parent and keys: an engine hashes a prompt for its
        lookup, its allocate and its store, the store's with the output appended; the shared blocks are reused."""

    def keys(self, tokens: Tokens, extra: bytes | str | None = None, *, parent: bytes | None = None) -> list[bytes]:
        """Keys of every full block of ``tokens``; a trailing partial block gets none.

        ``tokens``: see ``token_array``. ``extra`` (e.g. a multimodal content hash)
        is mixed into every block's key. ``parent``: the key of the block before
        ``tokens`` (they continue a chain whose earlier keys are known), else the root.
        """
        array = token_array(tokens)
        num_blocks = len(array) // self.block_size
        data = array[: num_blocks * self.block_size].tobytes()
        stride = self.block_size * _TOKEN_DTYPE.itemsize
        salt = extra.encode() if isinstance(extra, str) else (extra or b"")
        origin = previous = self._root if parent is None else parent
        keys = self._shared_prefix(data, salt, origin, stride)
        if keys:
            previous = keys[-1]
        buffer = memoryview(data)
        blake2b = hashlib.blake2b
        for start in range(len(keys) * stride, num_blocks * stride, stride):
            digest = blake2b(previous, digest_size=KEY_BYTES)
            digest.update(buffer[start : start + stride])
            if salt:
                digest.update(salt)
            previous = digest.digest()
            keys.append(previous)
        self._last = (data, salt, origin, tuple(keys))
        return keys

    def _shared_prefix(self, data: bytes, salt: bytes, parent: bytes, stride: int) -> list[bytes]:
        """The last call's keys of the blocks ``data`` shares with it (the same salt and parent), or none."""
        last_data, last_salt, last_parent, last_keys = self._last  # one tuple: consistent across threads
        if salt != last_salt or parent != last_parent or not last_keys:
            return []
        shared = min(len(data), len(last_data))
        if data[:shared] != last_data[:shared]:  # a memcmp: a few µs where the blocks' BLAKE2b take a ms
            return []
        return list(last_keys[: shared // stride])
