"""The tiercache namespace of an SGLang rank's pages: who may share a page's KV with whom.

Two SGLang instances share a page exactly when its bytes are interchangeable: the same model, the same
shard of it and the same page bytes. The model is the core's ``ModelIdentity``
(``tiercache.blocks.model_identity``) of the checkpoint SGLang serves, read from SGLang's published model
settings (``--model-path``, ``--revision``, ``--dtype``, ``--quantization``, ``--json-model-override-args``):
its config and a digest of its weights, never the served name. Where SGLang has published none (the backend
built outside a server), ``HiCacheStorageConfig.model_name`` is taken as the checkpoint (a path or a hub id
in the local cache) or, failing that, as the name that stands for the weights. From ``HiCacheStorageConfig``:
the tensor-parallel
rank and size (not for MLA, whose latent KV every TP rank holds whole, so all ranks share one copy, as
SGLang's own file backend does), the pipeline stage and the attention context-parallel shard. From the
registered host pool: the memory layout (each stores a page's elements in its own order), dtype, page
size, the model's KV geometry and how a page splits into pieces. A page key is then
``RemoteStore.key(page hash + piece number)``; the topology's ``model.secret_env`` keys the namespace there
(``tiercache.remote.secret``), so instances with different secrets never share a page.
"""

from __future__ import annotations

from typing import Any

from tiercache.blocks.keys import Namespace
from tiercache.blocks.model_identity import ModelIdentity, checkpoint_identity
from tiercache.blocks.namespaces import PageFormat, engine_namespace
from tiercache.integrations.sglang.pages import HostPages

ENGINE = "sglang-hicache"
"""The page format's engine: SGLang's HiCache host pages, split into pieces as ``pages`` does."""
FORMAT_VERSION = 1
"""Changes when the way pages become blocks changes, so older blocks stop matching."""


class MissingModelIdentity(ValueError):
    """SGLang gave no model: without it different models could share KV."""


def model_identity(config: Any) -> ModelIdentity:
    """The served model's identity, from SGLang's model settings or else ``config.model_name``."""
    served = _served_model()
    if served is not None:
        return checkpoint_identity(**served)
    if not config.model_name:
        raise MissingModelIdentity(
            "tiercache's SGLang backend needs the model's identity (SGLang's --model-path, or "
            "HiCacheStorageConfig.model_name); without it different models would share KV"
        )
    return checkpoint_identity(config.model_name, "auto")


def _served_model() -> dict[str, Any] | None:
    """SGLang's published model settings as ``checkpoint_identity``'s arguments (None outside a server)."""
    try:
        from sglang.srt.runtime_context import get_model

        model = get_model()
        path = model.model_path
    except (ImportError, ValueError, AttributeError):  # not published: the backend runs outside a server
        return None
    return {
        "model": path, "dtype": str(model.dtype), "revision": model.revision, "cache_dir": model.download_dir,
        "settings": {"quantization": model.quantization, "overrides": model.json_model_override_args},
    }


def page_namespace(config: Any, pages: HostPages, model: ModelIdentity) -> Namespace:
    """The namespace of this rank's pages (``config`` is SGLang's ``HiCacheStorageConfig``), built by the core's one
    builder (``tiercache.blocks.namespaces.engine_namespace``)."""
    fields: dict[str, Any] = {
        "version": FORMAT_VERSION, "layout": pages.layout, "dtype": str(pages.dtype).removeprefix("torch."),
        "page_size": pages.page_size, "pieces": pages.pieces, "piece_bytes": pages.piece_bytes,
        "geometry": dict(pages.geometry), "pp": [config.pp_rank, config.pp_size],
    }
    if config.attn_cp_size > 1:
        fields["cp"] = [config.attn_cp_rank, config.attn_cp_size]
    if config.is_mla_model:  # one latent copy, whole on every TP rank: every rank shares it
        fields["attention"], tp_rank = "mla", 0
    else:
        fields["attention"], fields["tp_size"], tp_rank = "mha", config.tp_size, config.tp_rank
    return engine_namespace(model, PageFormat(ENGINE, fields), tp_rank)
