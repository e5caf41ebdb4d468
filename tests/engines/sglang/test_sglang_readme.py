"""README's two SGLang configurations, run as a user copies them: the JSON after
``--hicache-storage-backend-extra-config``, with only the server addresses replaced by the test's own."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.sglang_parts import alloc, eventually, host_pool, page_bytes, page_keys, storage_config

REPO = Path(__file__).resolve().parents[3]
README = (REPO / "docs" / "engines.md").read_text()
CONFIGS = re.findall(r"--hicache-storage-backend-extra-config '(\{.*?\})'", README, flags=re.DOTALL)
README_CENTRAL, README_REGION = "redis://127.0.0.1:6379", "redis://127.0.0.1:6380"
PAGES = 4


def readme_config(marker: str, central: RedisServer, region: RedisServer | None = None) -> dict[str, Any]:
    """The one README configuration containing ``marker``, pointed at the test's servers."""
    (text,) = [config for config in CONFIGS if marker in config]
    if region is not None:
        text = text.replace(README_REGION, region.url)
    return json.loads(text.replace(README_CENTRAL, central.url))


def launched(extra: dict[str, Any]) -> tuple[Any, Any]:
    """A host pool and the backend SGLang builds from that extra config (``--hicache-mem-layout page_first``)."""
    pool = host_pool("page_first")
    config = storage_config(None)
    config.extra_config = extra
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return pool, backend


def test_readme_has_the_two_configurations_with_the_dynamic_backend() -> None:
    assert len(CONFIGS) == 2
    assert README.count("--hicache-storage-backend dynamic") == 2


def test_the_redis_configuration_shares_pages_between_instances(redis_server: RedisServer) -> None:
    extra = readme_config('"type": "redis"', redis_server)
    (writer_pool, writer), (reader_pool, reader) = launched(extra), launched(extra)
    keys, written, read = page_keys(PAGES), alloc(writer_pool, PAGES), alloc(reader_pool, PAGES)
    try:
        assert writer.batch_set_v1(keys, written) == [True] * PAGES
        assert reader.batch_exists(keys) == PAGES
        assert reader.batch_get_v1(keys, read) == [True] * PAGES
        assert page_bytes(reader_pool, read) == page_bytes(writer_pool, written)
    finally:
        writer.close()
        reader.close()


def test_the_regional_configuration_reads_across_regions(
    redis_factory: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the topology's path is relative to SGLang's working directory
    central, region_a, region_b = redis_factory(), redis_factory(), redis_factory()
    (writer_pool, writer) = launched(readme_config('"force_latest": true', central, region_a))
    (reader_pool, reader) = launched(readme_config('"force_latest": true', central, region_b))
    assert reader.options.force_latest
    keys, written, read = page_keys(PAGES), alloc(writer_pool, PAGES), alloc(reader_pool, PAGES)
    try:
        assert writer.batch_set_v1(keys, written) == [True] * PAGES
        assert eventually(lambda: reader.batch_get_v1(keys, read) == [True] * PAGES), "never replicated"
        assert page_bytes(reader_pool, read) == page_bytes(writer_pool, written)
    finally:
        writer.close()
        reader.close()
