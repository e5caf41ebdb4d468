"""tiercache's SGLang HiCache backend on SGLang 0.5.23's own classes and real redis-servers.

Built by SGLang's storage factory (``dynamic``) and attached to SGLang's host KV pools in every MHA and MLA
layout, pages round-trip byte-exact through Redis: by the zero-copy v1 calls and by the flat-page calls
alike (they share blocks), into a second backend and a second process. ``batch_exists`` is the prefix up
to the first page missing a piece and reads no value. Another model, TP rank, layout or dtype misses; MLA
ranks share. A bad extra config is a clear error naming the flag and field.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from support import module_command, with_tests_on_path

from tiercache.config import ConfigError
from tiercache.integrations.sglang import TierCacheStorage
from tiercache.integrations.sglang.namespace import MissingModelIdentity
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.sglang_parts import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE_SIZE,
    alloc,
    attach,
    digests,
    host_pool,
    page_bytes,
    page_keys,
    redis_topology,
    scramble,
    storage_config,
)

PAGES = 6
LAYOUTS = [(False, layout) for layout in MHA_LAYOUTS] + [(True, layout) for layout in MLA_LAYOUTS]
SECOND_PROCESS_TIMEOUT_S = 120


def written(server: RedisServer, pool_layout: str = "page_first", mla: bool = False, pages: int = PAGES, **config):
    """A writer's pool, backend, keys and host indices, its pages stored by ``batch_set_v1``."""
    pool = host_pool(pool_layout, mla=mla)
    backend = attach(pool, redis_topology(server.url), mla=mla, **config)
    keys, indices = page_keys(pages), alloc(pool, pages)
    assert backend.batch_set_v1(keys, indices) == [True] * pages
    return pool, backend, keys, indices


def redis_keys(server: RedisServer) -> set[str]:
    return set(server.cli("--scan").split())


def command_calls(server: RedisServer, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats)."""
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_the_storage_factory_builds_it_and_a_bad_extra_config_is_a_clear_error(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "redis.yaml"
    path.write_text(yaml.safe_dump(redis_topology(redis_server.url)))
    pool = host_pool()
    backend = attach(pool, str(path))
    assert isinstance(backend, TierCacheStorage) and isinstance(backend, HiCacheStorage)
    backend.close()

    def refused(topology: object, **config: object) -> str:
        with pytest.raises((ConfigError, MissingModelIdentity)) as error:
            StorageBackendFactory.create_backend("dynamic", storage_config(topology, **config), pool)
        return str(error.value)

    assert refused(None) == (
        "--hicache-storage-backend-extra-config: topology: expected the path of a remote-only tiercache topology "
        "(YAML), or that topology as a JSON object, got None"
    )
    assert refused(str(tmp_path / "missing.yaml")).startswith(f"{tmp_path / 'missing.yaml'}: <top level>: expected")
    assert "tiers[0].type: expected a remote tier type" in refused({"tiers": [{"name": "gpu", "type": "gpu"}]})
    message = refused(str(path), force_latest="yes")
    assert message == "--hicache-storage-backend-extra-config: force_latest: expected true or false, got 'yes'"
    assert refused(str(path), force_latest=True) == (
        "--hicache-storage-backend-extra-config: force_latest: expected false, or a topology with a versioned tier "
        "(type: regional), got True"
    )
    assert "overrides" in refused(str(path), overrides=["tiers.redis0.options.url"])
    assert "tiers[0].options.timeout_s" in refused(str(path), overrides={"tiers.redis0.options.timeout_s": -1})
    assert "model's identity" in refused(str(path), model=None)
    # a misspelt key of tiercache's is named, not ignored (SGLang's own and other keys still are)
    assert refused(str(path), force_latets=True) == (
        "--hicache-storage-backend-extra-config: force_latets: expected one of tiercache's keys (topology, "
        "overrides, force_latest); did you mean 'force_latest'?, got 'an unknown key'"
    )
    assert "did you mean 'overrides'" in refused(str(path), overides={"tiers.redis0.options.url": "redis://h:1"})
    assert "did you mean 'topology'" in refused(None, topolgy=str(path))
    attach(pool, str(path), prefetch_threshold=128, hicache_storage_pass_prefix_keys=False).close()


@pytest.mark.parametrize(("mla", "layout"), LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{x}" for m, x in LAYOUTS])
def test_v1_pages_round_trip_byte_exact_into_another_pool_and_only_where_asked(
    redis_server: RedisServer, mla: bool, layout: str
) -> None:
    writer_pool, writer, keys, indices = written(redis_server, layout, mla=mla)
    reader_pool = host_pool(layout, mla=mla)
    scramble(reader_pool, seed=1)
    reader = attach(reader_pool, redis_topology(redis_server.url), mla=mla)
    try:
        before, targets, after = alloc(reader_pool, 2), alloc(reader_pool, PAGES), alloc(reader_pool, 2)
        around = page_bytes(reader_pool, before) + page_bytes(reader_pool, after)
        assert reader.batch_exists(keys) == PAGES
        assert reader.batch_get_v1(keys, targets) == [True] * PAGES
        assert page_bytes(reader_pool, targets) == page_bytes(writer_pool, indices)
        assert page_bytes(reader_pool, before) + page_bytes(reader_pool, after) == around, "wrote outside its pages"
    finally:
        writer.close()
        reader.close()


def test_batch_exists_is_the_prefix_up_to_the_first_page_missing_a_piece_and_reads_no_value(
    redis_server: RedisServer,
) -> None:
    pool = host_pool("page_first")
    backend = attach(pool, redis_topology(redis_server.url))
    keys, indices = page_keys(PAGES), alloc(pool, PAGES)
    try:
        assert backend.batch_set_v1(keys[:3], indices[: 3 * PAGE_SIZE]) == [True] * 3
        stored = redis_keys(redis_server)
        assert backend.batch_set_v1(keys[3:4], indices[3 * PAGE_SIZE : 4 * PAGE_SIZE]) == [True]
        third = sorted(redis_keys(redis_server) - stored)
        assert len(third) == 2, "a page_first MHA page is two blocks: K and V"
        assert backend.batch_set_v1(keys[4:], indices[4 * PAGE_SIZE :]) == [True] * 2
        assert backend.batch_exists(keys) == PAGES

        gets = command_calls(redis_server, "get")
        redis_server.cli("DEL", third[1])
        assert backend.batch_exists(keys) == 3
        assert backend.batch_exists(keys[:3]) == 3
        assert backend.batch_exists([keys[0], "f" * 64, keys[1]]) == 1
        assert not backend.exists(keys[3]) and backend.exists(keys[4])
        assert command_calls(redis_server, "get") == gets, "a presence check read a value"
        assert backend.batch_get_v1(keys, alloc(pool, PAGES)) == [True] * 3 + [False] + [True] * 2
    finally:
        backend.close()


@pytest.mark.parametrize(("mla", "layout"), [(False, "layer_first"), (False, "page_head"), (True, "page_first")])
def test_flat_page_calls_round_trip_and_share_blocks_with_the_v1_calls(
    redis_server: RedisServer, mla: bool, layout: str
) -> None:
    pool = host_pool(layout, mla=mla)
    backend = attach(pool, redis_topology(redis_server.url), mla=mla)
    keys, indices = page_keys(PAGES), alloc(pool, PAGES)
    starts = indices[::PAGE_SIZE].tolist()
    try:
        # SGLang's own non-zero-copy paths (HiCacheController._generic_page_set / _generic_page_get).
        assert backend.batch_set(keys, [pool.get_data_page(start) for start in starts]) is True
        targets = alloc(pool, PAGES)
        assert backend.batch_get_v1(keys, targets) == [True] * PAGES
        assert page_bytes(pool, targets) == page_bytes(pool, indices)

        scramble(pool, seed=5)
        pages = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        assert all(page is not None for page in pages)
        for start, page in zip(targets[::PAGE_SIZE].tolist(), pages, strict=True):
            pool.set_from_flat_data_page(start, page)
        stored_pages = page_bytes(pool, targets)
        assert backend.batch_set_v1(keys, targets) == [True] * PAGES  # the same blocks, rewritten
        one = pool.get_dummy_flat_data_page()
        assert backend.get(keys[2], one) is one
        assert one.view(torch.uint8).numpy().tobytes() == stored_pages[2]

        other = page_keys(2, seed=9)
        assert backend.set(other[0], pool.get_data_page(starts[0])) is True
        assert backend.exists(other[0]) and not backend.exists(other[1])
        assert backend.get(other[1], pool.get_dummy_flat_data_page()) is None
        assert backend.batch_get(other)[1] is None
    finally:
        backend.close()


def test_a_second_process_reads_the_pages(redis_server: RedisServer) -> None:
    pool, backend, keys, indices = written(redis_server, "layer_first")
    backend.close()
    request = {"topology": redis_topology(redis_server.url), "layout": "layer_first", "mla": False, "keys": keys}
    result = subprocess.run(
        module_command("sglang_second_process", json.dumps(request)),
        capture_output=True, text=True, timeout=SECOND_PROCESS_TIMEOUT_S, env=with_tests_on_path(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer == {"held": PAGES, "filled": [True] * PAGES, "digests": digests(page_bytes(pool, indices))}


def test_another_model_tp_rank_layout_or_dtype_misses_and_mla_tp_ranks_share(redis_server: RedisServer) -> None:
    _, writer, keys, _ = written(redis_server, "page_first", tp_rank=0, tp_size=2)
    url = redis_server.url
    try:
        for layout, config in [
            ("page_first", {"model": "org/model-b", "tp_size": 2}),
            ("page_first", {"tp_rank": 1, "tp_size": 2}),
            ("page_first", {"tp_size": 1}),
            ("page_first_direct", {"tp_size": 2}),  # the same piece sizes, another byte order
        ]:
            pool = host_pool(layout)
            other = attach(pool, redis_topology(url), **config)
            assert other.batch_exists(keys) == 0, (layout, config)
            assert other.batch_get_v1(keys, alloc(pool, PAGES)) == [False] * PAGES
            other.close()
        half = host_pool("page_first", dtype=torch.float16)  # bfloat16's size, another dtype
        other = attach(half, redis_topology(url), tp_size=2)
        assert other.batch_exists(keys) == 0
        other.close()
        same = attach(host_pool("page_first"), redis_topology(url), tp_size=2)
        assert same.batch_exists(keys) == PAGES
        same.close()

        mla_pool, mla_writer, mla_keys, mla_indices = written(redis_server, "page_first", mla=True, tp_size=2)
        rank1_pool = host_pool("page_first", mla=True)
        scramble(rank1_pool, seed=3)
        rank1 = attach(rank1_pool, redis_topology(url), mla=True, tp_rank=1, tp_size=2)
        targets = alloc(rank1_pool, PAGES)
        assert rank1.batch_get_v1(mla_keys, targets) == [True] * PAGES
        assert page_bytes(rank1_pool, targets) == page_bytes(mla_pool, mla_indices)
        mla_writer.close()
        rank1.close()
    finally:
        writer.close()


def test_storage_metrics_and_clear_deletes_nothing(redis_server: RedisServer) -> None:
    pool, backend, keys, _ = written(redis_server, metrics=True)
    try:
        assert backend.batch_get_v1(keys, alloc(pool, PAGES)) == [True] * PAGES
        metrics = backend.get_stats()
        assert (metrics.backup_pgs, metrics.prefetch_pgs) == ([PAGES], [PAGES])
        assert all(rate > 0 for rate in metrics.backup_bandwidth + metrics.prefetch_bandwidth)
        assert backend.get_stats().prefetch_pgs == []
        backend.clear()
        assert backend.batch_exists(keys) == PAGES
    finally:
        backend.close()
