"""What an engine says of itself when it attaches, so a server whose topology names no model serves the first.

vLLM's connector derives its model id and its pages' format from vLLM's own
configs, which an operator cannot write in a YAML file; a host server started
with a topology of tiers alone (``model`` at most ``tenant``-free, no
``layout``) takes them from the first engine that attaches (``describe``, sent
at attach; ``adopt``, on the server), and every later engine must match it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tiercache.blocks.layout import PageLayout
from tiercache.blocks.namespaces import PageFormat
from tiercache.config import ConfigError, TierCacheConfig, config_from_dict

ENGINE_SECTIONS = ("model", "layout")
"""The topology's sections an engine supplies when the topology has neither."""
PLACEHOLDER = {"model": {"id": "host-server"}, "layout": {"block_bytes": 1, "block_size": 1}}
"""What the tiers of a topology without an engine's sections are checked against at start (their fields, not
their sizes: those come with the engine)."""


def describe(config: TierCacheConfig) -> dict[str, Any]:
    """The engine's model and layout, as plain data."""
    layout = config.layout
    if isinstance(layout, PageLayout):
        form = layout.engine_format
        shape: dict[str, Any] = {"block_bytes": layout.block_bytes, "block_size": layout.block_size}
        pages = {"engine_format": None if form is None else {"engine": form.engine, "fields": dict(form.fields)},
                 "element_dtype": layout.element_dtype, "group_elements": layout.group_elements}
    else:
        shape = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                 "dtype": layout.dtype, "block_size": layout.block_size, "memory": layout.memory.value}
        pages = None
    return {"model": dataclasses.asdict(config.model), "layout": shape, "pages": pages}


def needs_engine(topology: Mapping[str, Any]) -> bool:
    """Whether a server's topology waits for its first engine's model and layout."""
    return "layout" not in topology


def check_tiers(topology: Mapping[str, Any], source: str) -> None:
    """Refuse a topology without an engine's sections whose tiers are wrong, before any engine comes."""
    if "model" in topology:
        raise ConfigError(source, "model", "nothing, or a layout too: the first engine to attach supplies both",
                          topology["model"])
    config_from_dict({**topology, **PLACEHOLDER}, source, engine_pool=True)


def adopt(topology: Mapping[str, Any], source: str, description: Mapping[str, Any]) -> TierCacheConfig:
    """The server's topology with an engine's model and layout (``ConfigError``: not a description)."""
    try:
        config = config_from_dict({**topology, "model": dict(description["model"]),
                                   "layout": dict(description["layout"])}, source, engine_pool=True)
        pages = description.get("pages")
        if pages is not None:
            form = pages["engine_format"]
            config.layout = dataclasses.replace(
                config.layout, engine_format=None if form is None else PageFormat(form["engine"], dict(form["fields"])),
                element_dtype=pages["element_dtype"], group_elements=pages["group_elements"])
    except (KeyError, TypeError, AttributeError) as error:
        raise ConfigError(source, "engine", "an engine's model and layout", repr(error)) from None
    return config
