"""The vLLM connector's ``codec`` key: every remote tier that names none gets it, and since the connector's pages
are opaque to tiercache, a lossy level is declined there with a log line and the tier stores exact KV."""

from __future__ import annotations

import logging

import pytest

from tiercache.blocks.model_identity import ModelIdentity
from tiercache.blocks.namespaces import PageFormat
from tiercache.codecs.levels import Level
from tiercache.config import ConfigError
from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.options import ConnectorOptions
from tiercache.remote.build import build_tier, model_namespace
from tiercache.tiers.coded import CodedTier

GEOMETRY = SlotGeometry((GroupGeometry(GroupKind.FULL, ("model.layers.0.self_attn.attn",), 32768),), 1, 32)
MODEL = ModelIdentity("config-digest", "name:tiny@main", "float32")
PAGES = PageFormat("vllm-connector", {"device": "cpu"})


def topology() -> dict[str, object]:
    return {"tiers": [{"type": "cpu", "capacity_blocks": 16},
                      {"name": "near", "type": "redis", "options": {"url": "redis://127.0.0.1:1"}},
                      {"name": "far", "type": "redis", "options": {"url": "redis://127.0.0.1:2"},
                       "codec": {"levels": ["exact"]}}]}


def test_the_codec_key_reaches_the_remote_tiers_that_name_none(caplog: pytest.LogCaptureFixture) -> None:
    options = ConnectorOptions.parse({"topology": topology(), "codec": {"levels": ["int8"]}})
    config = options.config(MODEL, GEOMETRY, PAGES)
    assert [tier.codec.levels for tier in config.tiers] == [[Level.EXACT], [Level.INT8], [Level.EXACT]]
    codec = model_namespace(config)[1]
    with caplog.at_level(logging.WARNING, logger="tiercache.remote.build"):
        near = build_tier(config.tiers[1], codec, config.layout.bytes_per_block, config.layout)
    assert not isinstance(near, CodedTier) and near.codec.coding is None
    assert "declined, storing exact KV" in caplog.text and "opaque pages" in caplog.text


def test_a_codec_key_that_is_no_codec_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="codec"):
        ConnectorOptions.parse({"topology": topology(), "codec": "int8"})
    options = ConnectorOptions.parse({"topology": topology(), "codec": {"levels": ["int4"]}})
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec\.levels"):
        options.config(MODEL, GEOMETRY, PAGES)
