"""One namespace builder: page formats, ``engine_namespace`` and a topology's opaque ``PageLayout``."""

from __future__ import annotations

import hashlib
import json

import pytest

from tiercache.blocks.keys import Namespace
from tiercache.blocks.layout import KVLayout, MemoryOrder, PageLayout
from tiercache.blocks.model_identity import ModelIdentity
from tiercache.blocks.namespaces import PageFormat, engine_namespace
from tiercache.config import ConfigError, config_from_dict
from tiercache.remote.build import model_namespace

IDENTITY = ModelIdentity("config-digest", "checkpoint:abcd", "float16")
FIELDS = {"dtype": "float16", "heads": 8, "groups": [{"layers": ["a", "b"], "window": 0}]}


def test_a_fingerprint_is_sha256_of_the_sorted_fields_whatever_their_order() -> None:
    shuffled = dict(reversed(list(FIELDS.items())))
    expected = hashlib.sha256(json.dumps(FIELDS, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    assert PageFormat("eng", FIELDS).fingerprint() == f"eng-{expected}"
    assert PageFormat("eng", shuffled).fingerprint() == PageFormat("eng", FIELDS).fingerprint()


def test_any_field_the_engine_or_the_rank_changes_the_namespace() -> None:
    base = engine_namespace(IDENTITY, PageFormat("eng", FIELDS))
    others = [
        engine_namespace(IDENTITY, PageFormat("other-engine", FIELDS)),
        engine_namespace(IDENTITY, PageFormat("eng", {**FIELDS, "heads": 4})),
        engine_namespace(IDENTITY, PageFormat("eng", FIELDS), rank=1),
        engine_namespace(IDENTITY, PageFormat("eng", FIELDS), tenant="acme"),
        engine_namespace(IDENTITY, PageFormat("eng", FIELDS), lora="sql"),
        engine_namespace(ModelIdentity("config-digest", "checkpoint:ffff", "float16"), PageFormat("eng", FIELDS)),
    ]
    roots = {base.root(), *(other.root() for other in others)}
    assert len(roots) == len(others) + 1


def test_an_identity_and_its_model_id_name_one_namespace() -> None:
    page_format = PageFormat("eng", FIELDS)
    assert engine_namespace(IDENTITY, page_format, 2) == engine_namespace(IDENTITY.model_id, page_format, 2)
    assert engine_namespace(IDENTITY, page_format, 2) == Namespace(IDENTITY.model_id, page_format.fingerprint(), 2)


def test_a_layout_page_format_names_every_field_that_fixes_a_block() -> None:
    layout = KVLayout(4, 2, 64, "float16", 16)
    variants = [KVLayout(5, 2, 64, "float16", 16), KVLayout(4, 4, 64, "float16", 16),
                KVLayout(4, 2, 128, "float16", 16), KVLayout(4, 2, 64, "bfloat16", 16),
                KVLayout(4, 2, 64, "float16", 32), KVLayout(4, 2, 64, "float16", 16, MemoryOrder.LAYER_MAJOR)]
    prints = {layout.page_format().fingerprint(), *(v.page_format().fingerprint() for v in variants)}
    assert len(prints) == len(variants) + 1


def test_page_layouts_are_bytes_named_by_the_engine_or_by_their_size() -> None:
    declared = PageLayout(block_bytes=4096, block_size=16)
    assert (declared.bytes_per_block, declared.block_shape, declared.dtype) == (4096, (4096,), "uint8")
    assert declared.page_format() == PageFormat("tiercache-pages", {"block_bytes": 4096, "block_size": 16})
    described = PageLayout(4096, 16, PageFormat("eng", FIELDS))
    assert described.page_format() == PageFormat("eng", FIELDS)
    with pytest.raises(ValueError, match="block_bytes"):
        PageLayout(block_bytes=0)


TOPOLOGY = {
    "model": {"id": "m", "tenant": "acme"},
    "layout": {"block_bytes": 65536, "block_size": 32},
    "tiers": [{"type": "cpu", "capacity_blocks": 4}],
}


def test_a_topology_below_an_engine_pool_says_opaque_pages_and_gets_the_one_namespace() -> None:
    config = config_from_dict(TOPOLOGY, "t.yaml", engine_pool=True)
    assert config.layout == PageLayout(65536, 32)
    namespace, _ = model_namespace(config)
    assert namespace == engine_namespace("m", PageLayout(65536, 32).page_format(), tenant="acme")


def test_a_gpu_pool_cannot_hold_opaque_pages() -> None:
    data = {**TOPOLOGY, "tiers": [{"type": "gpu", "capacity_blocks": 4, "options": {"device": "cpu"}}]}
    with pytest.raises(ConfigError, match=r"t\.yaml: layout: expected num_layers, num_kv_heads and head_dim"):
        config_from_dict(data, "t.yaml")


def test_a_bad_page_layout_names_its_field() -> None:
    data = {**TOPOLOGY, "layout": {"block_bytes": -1, "block_size": 32}}
    with pytest.raises(ConfigError, match=r"t\.yaml: layout\.block_bytes: expected a positive integer"):
        config_from_dict(data, "t.yaml", engine_pool=True)
    kv = {**TOPOLOGY, "layout": {"num_layers": 0, "num_kv_heads": 2, "head_dim": 8}}
    with pytest.raises(ConfigError, match=r"t\.yaml: layout\.num_layers: expected a positive integer"):
        config_from_dict(kv, "t.yaml", engine_pool=True)
