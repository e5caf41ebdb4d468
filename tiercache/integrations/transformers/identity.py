"""The ``ModelIdentity`` of a ``transformers`` model: the core's one rule, taken from the model in memory.

``CachedModel`` mixes it into every key it asks for, because the topology's
namespace (``model.id``, the layout) cannot tell two models of one KV shape
apart. The config is the model's as it runs (``config.to_dict()``), the dtype
the one its weights compute in, and the weights are digested in memory (the
tensors that compute the KV, whatever file they came from or however they were
changed since); only where they are not in memory (offloaded to the meta
device) is the checkpoint that ``name_or_path`` names digested instead.
"""

from __future__ import annotations

from typing import Any

from tiercache.blocks.model_identity import ModelIdentity, checkpoint_identity, find_checkpoint, tensors_identity

__all__ = ["hf_model_identity"]


def hf_model_identity(model: Any) -> ModelIdentity:
    """The identity of ``model`` (a ``transformers`` ``PreTrainedModel``), taken now.

    Weights changed later need a new identity (a new ``CachedModel``).
    """
    config, dtype = model.config.to_dict(), str(model.dtype)
    tensors = list(model.state_dict().items())
    if not any(tensor.is_meta for _, tensor in tensors):
        return tensors_identity(tensors, config, dtype)
    name, revision = str(getattr(model, "name_or_path", "") or ""), getattr(model.config, "_commit_hash", None)
    if not name or find_checkpoint(name, revision) is None:
        raise ValueError(
            "the model's weights are not in memory (meta device, offloaded) and its name_or_path "
            f"({name!r}) names no local checkpoint: load the weights before building CachedModel"
        )
    return checkpoint_identity(name, dtype, config=config, revision=revision)
