"""The connector driven as vLLM 0.33's GPU model runners drive it, and what it tells vLLM back.

- The V2 model runner with FULL CUDA graphs (``vllm/v1/worker/gpu/kv_connector.py``
  ``ActiveKVConnector``, the object that runner calls): ``start_load_kv`` outside
  any forward context, no per-layer hook at all, ``finish_forward``,
  ``post_forward``, empty steps through ``no_forward``. Loads land and stores
  are made all the same; nothing is reported failed.
- Two instances on different KV layouts (vLLM's own allocator, token-major LBNHC
  as flash-attention uses and block-outer BLHNC) share blocks through vLLM's
  scheduler, checked page by page at every layer's read.
- MLA under tensor parallelism: the latent is the same on every rank, so a slot
  keeps one copy, rank 0 stores it and every rank loads it.
- ``get_external_cache_hit_sources`` names each load's tier; ``reset_cache``
  empties the CPU tier and leaves the remotes; the workers' copy bytes and
  times arrive in vLLM's connector stats.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.vllm_connector import PROMPT, Instances, remote_written, request, tiers_of, totals
from support.vllm_parts import BLOCK, HEAD_SIZE, LAYERS, cpu_topology, simulated_remote
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheLayout, MLAAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache

from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata
from tiercache.integrations.vllm.connector.region import SharedRegion
from tiercache.integrations.vllm.connector.worker import ConnectorWorker

WHOLE = 6 * BLOCK
"""``PROMPT``'s whole blocks (all but its last 4 tokens)."""
HEADS = 2


def planned(layout: KVCacheLayout, blocks: int = 64) -> Callable[[VllmConfig], KVCacheConfig]:
    """A builder of vLLM's plan for ``LAYERS`` of two KV heads, laid out in ``layout``."""

    def build(config: VllmConfig) -> KVCacheConfig:
        config.cache_config.kv_cache_layout = layout.name
        config.cache_config.num_gpu_blocks = blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
        groups = get_kv_cache_groups(config, dict.fromkeys(LAYERS, spec))
        return get_kv_cache_config_from_groups(config, groups, blocks * spec.page_size_bytes * len(LAYERS))

    return build


def allocated(layout: KVCacheLayout) -> Callable[[KVCacheConfig], dict[str, torch.Tensor]]:
    return lambda plan: allocate_kv_cache(plan, torch.device("cpu"), layout)


def test_the_v2_runner_with_full_cuda_graphs_loads_and_stores_every_layer(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]), runner="v2")
    records = first.serve(request("a", PROMPT))
    assert totals(records)["stored_blocks"] == 6 and not totals(records).get("failed_stores")
    remote_written(first, "sim", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]), runner="v2")
    records = second.serve(request("b", PROMPT))
    assert second.new_request(records, "b").num_computed_tokens == WHOLE
    assert not [wrong for record in records for wrong in record.wrong_pages], "every layer read its loaded pages"
    assert not [record.invalid_blocks for record in records if record.invalid_blocks]
    assert totals(records)["loaded_blocks"] == 6 and not totals(records).get("failed_loads")


@pytest.mark.parametrize(("writer", "reader"), [(KVCacheLayout.LBNHC, KVCacheLayout.BLHNC),
                                                (KVCacheLayout.BHLNC, KVCacheLayout.LBHNC)],
                         ids=lambda layout: layout.name)
def test_instances_on_different_layouts_share_blocks(vllm: Instances, writer: KVCacheLayout,
                                                     reader: KVCacheLayout) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]), kv_config=planned(writer), kv=allocated(writer))
    first.serve(request("a", PROMPT))
    remote_written(first, "sim", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]), kv_config=planned(reader), kv=allocated(reader))
    records = second.serve(request("b", PROMPT))
    assert second.new_request(records, "b").num_computed_tokens == WHOLE
    assert not [wrong for record in records for wrong in record.wrong_pages], "each page read equals the model's"


def test_hits_are_named_by_the_tier_that_held_them_and_copies_are_timed(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    stored = totals(first.serve(request("a", PROMPT)))
    pages = 6 * len(LAYERS) * first.page_size(LAYERS[0])
    assert stored["store_copy_bytes"] == pages and stored["store_copy_us"] > 0
    remote_written(first, "sim", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    from_remote = second.serve(request("b", PROMPT))
    assert merged(from_remote) == {"external_unspecified": WHOLE}, "a remote store's hit"
    second.scheduler.reset_prefix_cache()  # vLLM's own cache emptied: the CPU tier serves the next one
    from_cpu = second.serve(request("c", PROMPT))
    assert merged(from_cpu) == {"host": WHOLE}
    loaded = totals([*from_remote, *from_cpu])
    assert loaded["load_copy_bytes"] == 2 * pages and loaded["load_copy_us"] > 0


def merged(records: list) -> dict[str, int]:
    sources: dict[str, int] = {}
    for record in records:
        for source, count in record.hits_by_source.items():
            sources[source] = sources.get(source, 0) + count
    return sources


def test_reset_cache_empties_the_cpu_tier_and_leaves_the_remotes(vllm: Instances) -> None:
    remote = simulated_remote()
    instance = vllm.new("reset", cpu_topology(remotes=[remote]))
    instance.serve(request("a", PROMPT))
    remote_written(instance, "sim", 6)
    assert tiers_of(instance).stats()["tiers"]["cpu"]["cached_blocks"] == 6
    assert instance.connector.reset_cache() is True
    assert tiers_of(instance).stats()["tiers"]["cpu"]["cached_blocks"] == 0
    instance.scheduler.reset_prefix_cache()
    records = instance.serve(request("b", PROMPT))
    assert merged(records) == {"external_unspecified": WHOLE}, "served again, from the remote"
    assert not [wrong for record in records for wrong in record.wrong_pages]


def mla_geometry(world: int) -> SlotGeometry:
    page = BLOCK * 3 * HEAD_SIZE * 2  # one latent head of float16
    group = GroupGeometry(GroupKind.FULL, tuple(LAYERS), page, replicated=True)
    return SlotGeometry((group,), world, BLOCK)


def test_mla_under_tensor_parallelism_keeps_one_copy_stored_by_rank_zero(tmp_path) -> None:
    geometry = mla_geometry(world=2)
    assert geometry.slot_bytes == len(LAYERS) * geometry.groups[0].page_bytes, "one copy, not one per rank"
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=3 * HEAD_SIZE, dtype=torch.float16)
    latent = (16, 1, BLOCK, spec.head_size)
    caches = [{name: torch.randn(latent).half() for name in LAYERS} for _ in range(2)]
    caches[1] = {name: caches[0][name].clone() for name in LAYERS}  # replicated: every rank computed the same
    path = tmp_path / "region"
    workers = [ConnectorWorker(geometry, 8, path, rank) for rank in range(2)]
    for worker, cache in zip(workers, caches, strict=True):
        worker.register_kv_caches(cache)
    SharedRegion.for_scheduler(path, 8, geometry.slot_bytes, 2)
    store = TierCacheConnectorMetadata(stores=[CopyJob(1, (3, 4), (5, 6), (0, 0))])
    caches[1][LAYERS[0]][5].fill_(7)  # were rank 1 to store, slot 3 would hold this, not rank 0's page
    for worker in workers:
        worker.bind(store)
        worker.end()
    reports = [worker.take_report() for worker in workers]
    assert [dict(report.done) for report in reports] == [{1: 1}, {1: 1}], "every rank reports the job"
    assert [worker.take_moved().get("store_copy_bytes", 0) for worker in workers] == [
        2 * geometry.slot_bytes, 0], "rank 0 copied both blocks, rank 1 nothing"
    load = TierCacheConnectorMetadata(loads=[CopyJob(2, (3, 4), (9, 10), (0, 0))])
    for worker, cache in zip(workers, caches, strict=True):
        worker.bind(load)
        worker.start()
        worker.end()
        assert worker.take_report() is not None
        for name in LAYERS:
            assert torch.equal(cache[name][9], caches[0][name][5]) and torch.equal(cache[name][10], caches[0][name][6])
