"""The vLLM connector's ``codec`` key: every remote tier that names none gets it; the connector names its pages'
element dtype and group size (the head size) in the layout, so ``int8`` codes them, while ``compact`` on pages
without the token map (``token_order`` adds it where it can read one), and any level on pages whose elements vLLM
did not type as floats, is declined with a log line (the tier stores exact KV)."""

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

GEOMETRY = SlotGeometry((GroupGeometry(GroupKind.FULL, ("model.layers.0.self_attn.attn",), 32768),), 1, 32,
                        "float32", 64)
BYTES_ONLY = SlotGeometry(GEOMETRY.groups, 1, 32)
"""What the connector sees of a KV cache whose elements are not floats (vLLM's fp8 cache, kept as uint8)."""
MODEL = ModelIdentity("config-digest", "name:tiny@main", "float32")
PAGES = PageFormat("vllm-connector", {"device": "cpu"})


def topology() -> dict[str, object]:
    return {"tiers": [{"type": "cpu", "capacity_blocks": 16},
                      {"name": "near", "type": "redis", "options": {"url": "redis://127.0.0.1:1"}},
                      {"name": "far", "type": "redis", "options": {"url": "redis://127.0.0.1:2"},
                       "codec": {"levels": ["exact"]}}]}


def test_the_codec_key_reaches_the_remote_tiers_that_name_none_and_int8_codes_the_pages() -> None:
    options = ConnectorOptions.parse({"topology": topology(), "codec": {"levels": ["int8"]}})
    config = options.config(MODEL, GEOMETRY, PAGES)
    assert [tier.codec.levels for tier in config.tiers] == [[Level.EXACT], [Level.INT8], [Level.EXACT]]
    assert (config.layout.element_dtype, config.layout.group_elements) == ("float32", 64)
    assert config.layout.page_format().fields == {"device": "cpu", "element_dtype": "float32", "group_elements": 64}
    codec = model_namespace(config)[1]
    near = build_tier(config.tiers[1], codec, config.layout.bytes_per_block, config.layout)
    assert isinstance(near, CodedTier) and near.config.levels == [Level.INT8]
    assert near.coding.geometry.pages and near.coding.geometry.groups == 32768 // 4 // 64
    far = build_tier(config.tiers[2], codec, config.layout.bytes_per_block, config.layout)
    assert not isinstance(far, CodedTier) and far.codec.coding is None


def test_pages_whose_elements_are_not_floats_and_the_compact_level_are_declined_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = ConnectorOptions.parse({"topology": topology(), "codec": {"levels": ["int8"]}})
    config = options.config(MODEL, BYTES_ONLY, PAGES)
    assert config.layout.element_dtype is None and config.layout.page_format() == PAGES
    codec = model_namespace(config)[1]
    with caplog.at_level(logging.WARNING, logger="tiercache.remote.build"):
        near = build_tier(config.tiers[1], codec, config.layout.bytes_per_block, config.layout)
    assert not isinstance(near, CodedTier) and near.codec.coding is None
    assert "declined, storing exact KV" in caplog.text and "opaque pages" in caplog.text
    caplog.clear()
    options = ConnectorOptions.parse({"topology": topology(), "codec": {"levels": ["compact"], "tables": "t.npz"}})
    config = options.config(MODEL, GEOMETRY, PAGES)
    with caplog.at_level(logging.WARNING, logger="tiercache.remote.build"):
        near = build_tier(config.tiers[1], codec, config.layout.bytes_per_block, config.layout)
    assert not isinstance(near, CodedTier)
    assert "codec level compact declined" in caplog.text and "storing exact KV" in caplog.text


def test_a_codec_key_that_is_no_codec_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="codec"):
        ConnectorOptions.parse({"topology": topology(), "codec": "int8"})
    options = ConnectorOptions.parse({"topology": topology(), "codec": {"levels": ["int4"]}})
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec\.levels"):
        options.config(MODEL, GEOMETRY, PAGES)
