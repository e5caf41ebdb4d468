"""The SGLang backend over a regional topology: two regions sharing a central store (real redis-servers).

SGLang in region A writes pages; SGLang in region B reads them byte-exact once replicated (through
central, back-filling its region). When A rewrites them, a backend in region C with ``"force_latest": true``
in its extra config reads the newest version, while region B's backend without it keeps serving its older
copy (stale copies are not invalidated here, so the difference shows).
"""

from __future__ import annotations

from collections.abc import Callable

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.sglang_parts import (
    alloc,
    attach,
    eventually,
    host_pool,
    page_bytes,
    page_keys,
    regional_topology,
    scramble,
)

PAGES = 5


def test_pages_cross_regions_and_force_latest_reads_the_newest_version(
    redis_factory: Callable[..., RedisServer],
) -> None:
    central, region_a, region_b, region_c = (redis_factory() for _ in range(4))
    writer_pool = host_pool("page_first")
    writer = attach(writer_pool, regional_topology(region_a.url, central.url))
    reader_pool, latest_pool = host_pool("page_first"), host_pool("page_first")
    scramble(reader_pool, seed=2)
    reader = attach(reader_pool, regional_topology(region_b.url, central.url, invalidate=False))
    latest = attach(latest_pool, regional_topology(region_c.url, central.url, invalidate=False), force_latest=True)
    keys, indices = page_keys(PAGES), alloc(writer_pool, PAGES)
    try:
        assert writer.batch_set_v1(keys, indices) == [True] * PAGES
        first = page_bytes(writer_pool, indices)
        assert eventually(lambda: reader.batch_exists(keys) == PAGES), "never replicated to central"
        targets = alloc(reader_pool, PAGES)
        assert reader.batch_get_v1(keys, targets) == [True] * PAGES
        assert page_bytes(reader_pool, targets) == first
        assert region_b.cli("DBSIZE").strip() != "0", "region B was not back-filled"

        scramble(writer_pool, seed=3)
        assert writer.batch_set_v1(keys, indices) == [True] * PAGES
        second = page_bytes(writer_pool, indices)
        assert second != first
        newest = alloc(latest_pool, PAGES)
        assert eventually(
            lambda: latest.batch_get_v1(keys, newest) == [True] * PAGES and page_bytes(latest_pool, newest) == second
        ), "force_latest never read the newest version"
        stale = alloc(reader_pool, PAGES)
        assert reader.batch_get_v1(keys, stale) == [True] * PAGES
        assert page_bytes(reader_pool, stale) == first, "without force_latest region B serves its own copy"
    finally:
        for backend in (writer, reader, latest):
            backend.close()
