"""The tiercache namespace of an SGLang rank's pages: who may share a page's KV with whom.

Two SGLang instances share a page exactly when its bytes are interchangeable: the same model, the same
shard of it and the same page bytes. From ``HiCacheStorageConfig``: the model's name, the tensor-parallel
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
from tiercache.integrations.sglang.pages import HostPages

FORMAT = "sglang-hicache-1"
"""Changes when the way pages become blocks changes, so older blocks stop matching."""


class MissingModelIdentity(ValueError):
    """SGLang gave no model name: without it different models could share KV."""


def model_identity(config: Any) -> str:
    """The model's name from SGLang's ``HiCacheStorageConfig``; refused when SGLang gave none."""
    if not config.model_name:
        raise MissingModelIdentity(
            "tiercache's SGLang backend needs the model's identity (HiCacheStorageConfig.model_name, from "
            "--served-model-name or --model-path); without it different models would share KV"
        )
    return config.model_name


def page_namespace(config: Any, pages: HostPages) -> Namespace:
    """The namespace of this rank's pages (``config`` is SGLang's ``HiCacheStorageConfig``)."""
    model = model_identity(config)
    shard = [f"pp{config.pp_rank}/{config.pp_size}"]
    if config.attn_cp_size > 1:
        shard.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if config.is_mla_model:
        attention, tp_rank = "mla", 0
    else:
        attention, tp_rank = f"mha:tp{config.tp_size}", config.tp_rank
    geometry = ",".join(f"{name}={value}" for name, value in sorted(pages.geometry.items()))
    fingerprint = ":".join([
        FORMAT, attention, pages.layout, str(pages.dtype).removeprefix("torch."), f"page{pages.page_size}",
        f"{pages.pieces}x{pages.piece_bytes}", geometry, *shard,
    ])
    return Namespace(model, fingerprint, tp_rank=tp_rank)
