"""What keeps one instance's KV from another's, and what the connector refuses before it copies a byte (vLLM 0.33).

Tenants (``cache_salt``), models (another ``config.json``) and KV-cache group
structures never share blocks; an unknown ``kv_connector_extra_config`` key is
refused when vLLM builds the connector; a KV layout it cannot map declines every
request (logged with the layer, shape and strides) while vLLM serves on. The
version guard lets the connector import on 0.33 and keeps the package's other
exports lazy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.vllm_connector import PROMPT, Instance, Instances, remote_written, request, totals
from support.vllm_parts import (
    BLOCK,
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    NUM_BLOCKS,
    cpu_topology,
    kv_cache_config,
    model_dir,
    simulated_remote,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from tiercache.config import ConfigError
from tiercache.integrations.vllm.connector.geometry import instance_geometry
from tiercache.integrations.vllm.connector.namespace import page_format


def served_tokens(instances: Instances, engine_id: str, remote: dict, req_id: str, *, salt: str | None = None,
                  model: Path | None = None) -> int:
    """A fresh instance serves ``PROMPT``: the tokens it had without computing them (vLLM's or loaded)."""
    instance = instances.new(engine_id, cpu_topology(remotes=[remote]), model=model)
    records = instance.serve(request(req_id, PROMPT, cache_salt=salt))
    return instance.new_request(records, req_id).num_computed_tokens


def test_cache_salt_keeps_tenants_apart(vllm: Instances) -> None:
    remote = simulated_remote()
    writer = vllm.new("writer", cpu_topology(remotes=[remote]))
    writer.serve(request("a", PROMPT, cache_salt="tenant-1"))
    remote_written(writer, "sim", 6)
    assert served_tokens(vllm, "other-tenant", remote, "b", salt="tenant-2") == 0
    assert served_tokens(vllm, "no-tenant", remote, "c") == 0
    assert served_tokens(vllm, "same-tenant", remote, "d", salt="tenant-1") == 6 * BLOCK


def test_another_model_config_is_another_namespace(vllm: Instances) -> None:
    remote = simulated_remote()
    path = model_dir(vllm.root / "served", "model", vocab_size=512)
    writer = vllm.new("writer", cpu_topology(remotes=[remote]), model=path)
    writer.serve(request("a", PROMPT))
    remote_written(writer, "sim", 6)
    model_dir(vllm.root / "served", "model", vocab_size=640)  # other weights under the same path and name
    assert served_tokens(vllm, "other-model", remote, "b", model=path) == 0
    model_dir(vllm.root / "served", "model", vocab_size=512)  # the first model back: its blocks again
    assert served_tokens(vllm, "same-model", remote, "c", model=path) == 6 * BLOCK


@pytest.mark.parametrize(("wrong", "meant"), [("shard_dir", "shared_dir"), ("topolgy", "topology"),
                                              ("force-latest", "force_latest")])
def test_an_unknown_extra_config_key_is_refused_naming_the_one_it_resembles(
    vllm: Instances, wrong: str, meant: str
) -> None:
    extra = {**vllm.extra(cpu_topology()), wrong: "x"}
    config = vllm_config(vllm.model, "typo", extra)
    with pytest.raises(ConfigError) as refused:
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())
    assert wrong in str(refused.value) and f"did you mean {meant!r}" in str(refused.value)


def declining_instance(vllm: Instances, engine_id: str, kv: dict[str, torch.Tensor]) -> Instance:
    """An instance whose worker registers ``kv`` (a layout the connector cannot map), then builds its scheduler."""
    return vllm.new(engine_id, cpu_topology(), kv=lambda _: kv)


def test_a_layout_it_cannot_map_declines_every_request_and_vllm_serves_on(vllm: Instances,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    strided = torch.zeros(len(LAYERS), NUM_BLOCKS, KV_HEADS, BLOCK, 2 * 2 * HEAD_SIZE)[..., ::2]  # content strided
    instance = declining_instance(vllm, "strided", {name: strided[i] for i, name in enumerate(LAYERS)})
    assert "innermost dimension is not contiguous" in caplog.text and f"layer {LAYERS[0]}" in caplog.text
    assert "strides" in caplog.text and "declines every request" in caplog.text
    for salt in ("a", "b"):  # a tenant of its own each: vLLM's own prefix cache has nothing for either
        records = instance.serve(request(salt, PROMPT, cache_salt=salt))
        assert instance.new_request(records, salt).num_computed_tokens == 0
        assert sum(record.external_hits for record in records) == 0 and not any(r.wrong_pages for r in records)
        assert totals(records).get("declined_requests") == 1 and "stored_blocks" not in totals(records)
    assert not list(vllm.root.glob("tiercache-*")), "a declined region's file is unlinked by the scheduler side"


def test_pages_of_another_size_than_the_spec_decline(vllm: Instances, caplog: pytest.LogCaptureFixture) -> None:
    half = {name: torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.float16) for name in LAYERS}
    instance = declining_instance(vllm, "size", half)
    assert "vLLM's KV cache spec says" in caplog.text
    records = instance.serve(request("r", PROMPT))
    assert totals(records).get("declined_requests") == 1


def two_groups(window: int) -> KVCacheConfig:
    """A full-attention and a sliding-window group (``window`` tokens) of one layer each."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                                sliding_window=window)
    groups = [KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], sliding)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="LBHNC")


def test_kv_cache_groups_of_another_structure_never_share_a_namespace(vllm: Instances) -> None:
    config = vllm_config(vllm.model, "groups", vllm.extra(cpu_topology()))
    formats = {
        page_format(config, kv, instance_geometry(config, kv).slots).fingerprint()
        for kv in (two_groups(64), two_groups(96), kv_cache_config())
    }
    assert len(formats) == 3, "another window, or one group of full attention: another namespace"
    assert page_format(config, two_groups(64), instance_geometry(config, two_groups(64)).slots).fingerprint() in formats


def test_fp8_scales_computed_at_run_time_decline_and_a_checkpoints_scales_do_not(vllm: Instances) -> None:
    config = vllm_config(vllm.model, "scales", vllm.extra(cpu_topology()))
    config.cache_config.cache_dtype = "fp8"
    assert instance_geometry(config, kv_cache_config()).slots is not None, "scales of the checkpoint: its identity's"
    config.cache_config.calculate_kv_scales = True  # earlier vLLMs' option: scales from the first batch
    declined = instance_geometry(config, kv_cache_config())
    assert declined.slots is None and "calculate_kv_scales" in (declined.declined or "")


def test_the_connector_imports_on_this_vllm_and_the_other_exports_stay_lazy() -> None:
    script = (
        "import sys\n"
        "import tiercache.integrations.vllm as adapter\n"
        "assert 'vllm' not in sys.modules, 'importing the package imports vLLM'\n"
        "from tiercache.integrations.vllm.connector import TierCacheConnector\n"
        "assert adapter.TierCacheConnector is TierCacheConnector\n"
        "assert 'tiercache.integrations.vllm.offloading.tier' not in sys.modules\n"
        "assert 'tiercache.integrations.vllm.offloading.policies' not in sys.modules\n"
        "assert adapter.TierCacheTier.__name__ == 'TierCacheTier'\n"
        "assert {adapter.TierCacheLRU.__name__, adapter.TierCacheS3FIFO.__name__} == {'TierCacheLRU', "
        "'TierCacheS3FIFO'}\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
