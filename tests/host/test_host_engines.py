"""A host server whose topology has tiers only takes its model and layout from the first engine that attaches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support.host_helpers import client, write
from support.lower_tiers_helpers import block_bytes, chain, until

from tiercache.blocks.namespaces import PageFormat
from tiercache.config import ConfigError, TierCacheConfig, config_from_dict
from tiercache.host.client import HostAttachError, HostTiers
from tiercache.host.engines import adopt, describe
from tiercache.host.server import HostServer

TIERS_ONLY = {"tiers": [{"type": "cpu", "capacity_bytes": "64KiB", "policy": "lru"}]}
PAGES = PageFormat("vllm", {"dtype": "bfloat16", "heads": 8, "head_size": 64, "world": 1})


def pages_config(model: str = "served-model", form: PageFormat = PAGES) -> TierCacheConfig:
    """An engine's topology as vLLM's connector builds it: opaque pages of its own format."""
    config = config_from_dict({"model": {"id": model, "tenant": "team-a"},
                               "layout": {"block_bytes": 1024, "block_size": 16},
                               "tiers": [{"type": "cpu", "capacity_blocks": 4}]}, environ={}, engine_pool=True)
    config.layout = dataclasses.replace(config.layout, engine_format=form, element_dtype="bfloat16",
                                        group_elements=64)
    return config


def test_a_description_adopted_gives_the_engine_s_namespace_and_pages() -> None:
    engine = pages_config()
    adopted = adopt(TIERS_ONLY, "host.yaml", describe(engine))
    assert adopted.layout == engine.layout and adopted.model == engine.model
    assert adopted.tiers[0].capacity_blocks == 64, "the server's capacity in the engine's block bytes"


def test_the_first_engine_sets_the_model_and_later_ones_must_match(
        socket_dir: Path, servers: list[HostServer], opened: list[HostTiers]) -> None:
    server = HostServer(TIERS_ONLY, socket_dir / "host.sock", shared_dir=socket_dir)
    servers.append(server.start())
    assert server.tiers is None and server.stats()["host"]["engines"] == 0, "no region before an engine says its size"
    first = client(server.socket_path, opened, config=pages_config())
    assert server.region is not None and server.region.slot_bytes == 1024 and server.region.num_slots == 64
    second = client(server.socket_path, opened, config=pages_config())
    keys = chain(first, 3, salt=1)
    write(first, keys)
    fetch = second.fetch(until(lambda: second.lookup(keys)))
    assert [bytes(second.buffer_view(slot)) for slot in fetch.slots()] == [block_bytes(first, key) for key in keys]
    fetch.release()
    for other in (pages_config(model="another-model"), pages_config(form=PageFormat("vllm", {"dtype": "float16"}))):
        with pytest.raises(HostAttachError, match="another model or page format"):
            HostTiers(other, server.socket_path).start()


def test_a_tiers_only_topology_is_checked_before_any_engine_comes(socket_dir: Path) -> None:
    with pytest.raises(ConfigError, match="policy"):
        HostServer({"tiers": [{"type": "cpu", "capacity_blocks": 4, "policy": "nope"}]}, socket_dir / "host.sock")
    with pytest.raises(ConfigError, match="model"):
        HostServer({"model": {"id": "m"}, **TIERS_ONLY}, socket_dir / "host.sock")
