"""One rule for "same namespace": the model's identity, the page format, the rank, the tenant and the LoRA adapter.

Two engines share a block exactly when its bytes are interchangeable
(docs/architecture.md, "Which model's KV"): the same model (``ModelIdentity``,
or a topology's ``model.id`` where the user names the model), the same page
format (everything beyond the model that fixes a page's bytes: the engine that
lays pages out and its fields: dtypes, heads, bytes, parallel sizes; a
``PageFormat``), the same rank's share of a page, and the same tenant and
adapter. Every adapter, and the topology of a ``TierManager``, builds its
namespace through ``engine_namespace``; what each adds to its page format is its
own ([engines](docs/engines.md)).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.blocks.keys import Namespace

if TYPE_CHECKING:
    from tiercache.blocks.model_identity import ModelIdentity

FORMAT_DIGEST_HEX = 32
"""Hex digits of a page format's digest (128 bits of SHA-256 over its fields)."""


@dataclass(frozen=True)
class PageFormat:
    """Everything beyond the model that fixes a page's bytes: who lays pages out (``engine``) and how (``fields``,
    plain JSON data: dtypes, heads, bytes, groups, parallel sizes)."""

    engine: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """``<engine>-<digest of the fields>``: stable across processes and hosts (sorted JSON, SHA-256)."""
        text = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        return f"{self.engine}-{hashlib.sha256(text.encode()).hexdigest()[:FORMAT_DIGEST_HEX]}"


def engine_namespace(
    model: ModelIdentity | str,
    page_format: PageFormat,
    rank: int = 0,
    *,
    tenant: str | None = None,
    lora: str | None = None,
) -> Namespace:
    """The namespace of ``rank``'s pages of ``model`` in ``page_format`` (``model``: an identity, or the topology's
    ``model.id``), for ``tenant`` and ``lora``; keyed later with a secret where the topology names one."""
    model_id = model if isinstance(model, str) else model.model_id
    return Namespace(model_id, page_format.fingerprint(), rank, tenant, lora)
