"""ModelIdentity: what tells one ``transformers`` model's KV from another's of the same shape.

The topology's namespace (``model.id``, the layout, rank, tenant, LoRA) says which
engines share a store; it cannot tell two models of one KV shape apart, and a
model that reused another's KV would continue the prompt wrongly without any
error. ``CachedModel`` therefore mixes this identity into every key it asks for:

* the config, every field but the few that only change what the forward returns
  (architecture, sizes, RoPE, windows, quantization: whatever decides K/V),
* ``name_or_path`` and the hub revision (``_commit_hash``) it was loaded from,
* the dtype the weights compute in,
* a digest of the weights (names, dtypes, shapes, bytes) when nothing names them
  (a model built from a config has an empty ``name_or_path``) or when asked
  (``weights_digest=True``: a fine-tune that keeps its base's config and name).

Two loads of one checkpoint get one identity in any process, so they share KV.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

__all__ = ["ModelIdentity"]

IDENTITY_BYTES = 16
"""The salt's length: a BLAKE2b digest as long as a block key."""
OUTPUT_ONLY_FIELDS = frozenset({"output_attentions", "output_hidden_states", "return_dict", "use_cache"})
"""Config fields that change what the forward returns, never the K/V it computes."""
NAME_FIELD = "_name_or_path"
"""Kept apart from the rest of the config: ``name_or_path`` is its own part of the identity."""


@dataclass(frozen=True)
class ModelIdentity:
    """A model's name, a digest of its config and dtype, and (where taken) a digest of its weights."""

    name_or_path: str
    config_digest: str
    weights_digest: str | None

    @classmethod
    def of(cls, model: Any, *, weights_digest: bool = False) -> ModelIdentity:
        """The identity of ``model`` (a ``transformers`` ``PreTrainedModel``), taken now.

        The weights are digested when ``weights_digest`` is set or the model has no
        ``name_or_path``; weights changed later need a new identity (a new ``CachedModel``).
        """
        config = model.config
        fields = {name: value for name, value in config.to_dict().items() if name not in OUTPUT_ONLY_FIELDS}
        fields.pop(NAME_FIELD, None)
        fields["tiercache:revision"] = getattr(config, "_commit_hash", None)
        fields["tiercache:weights_dtype"] = str(model.dtype)
        text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
        name = str(getattr(model, "name_or_path", "") or "")
        digest = _weights_digest(model) if weights_digest or not name else None
        return cls(name, hashlib.blake2b(text.encode(), digest_size=IDENTITY_BYTES).hexdigest(), digest)

    @property
    def salt(self) -> bytes:
        """The bytes mixed into every key of this model (``CachedModel`` puts them before a request's ``extra``)."""
        text = "\x1f".join(("tiercache-hf-v1", self.name_or_path, self.config_digest, self.weights_digest or ""))
        return hashlib.blake2b(text.encode(), digest_size=IDENTITY_BYTES).digest()


def _weights_digest(model: Any) -> str:
    """XXH3-128 of every tensor of the state dict, in name order (the name, dtype and shape included).

    XXH3 rather than BLAKE2b: it reads the weights at memory speed, and the digest
    only names them (the keys themselves are BLAKE2b).
    """
    digest = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.is_meta:
            raise ValueError(
                f"weights_digest: {name} has no data here (meta device, offloaded): give the model a name_or_path "
                f"that names its weights, or load them before building CachedModel"
            )
        digest.update(f"{name}\x1f{tensor.dtype}\x1f{tuple(tensor.shape)}\x1f".encode())
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()
