"""What SGLang sees when the store fails: misses and False, never an exception, never wrong KV.

Redis killed or frozen (SIGSTOP): every call answers within the store's deadlines with misses or
failed writes, and the backend serves again once the server is back. Values damaged on the server (a
flipped payload byte, a truncated value, two pages' values swapped, random bytes) fail those pages only;
every page reported read holds the bytes that were written. Host indices or tensors that are not this
pool's pages fail, they do not raise.
"""

from __future__ import annotations

import numpy as np
import pytest
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tiercache.integrations.sglang.pages import UnsupportedPool
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.sglang_parts import (
    PAGE_SIZE,
    alloc,
    attach,
    eventually,
    host_pool,
    page_bytes,
    page_keys,
    redis_topology,
    scramble,
    storage_config,
)

PAGES = 4


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_server_killed_or_frozen_gives_misses_and_failed_writes_then_serves_again(
    redis_server: RedisServer, fault: str
) -> None:
    pool = host_pool("page_first")
    backend = attach(pool, redis_topology(redis_server.url))
    keys, indices = page_keys(PAGES), alloc(pool, PAGES)
    more = page_keys(PAGES, seed=1)
    try:
        assert backend.batch_set_v1(keys, indices) == [True] * PAGES
        getattr(redis_server, fault)()
        try:
            starts = indices[::PAGE_SIZE].tolist()
            for _ in range(3):  # again while the breakers are open
                assert backend.batch_exists(keys) == 0
                assert backend.batch_get_v1(keys, alloc(pool, PAGES)) == [False] * PAGES
                assert backend.batch_set_v1(more, indices) == [False] * PAGES
                assert backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]) == [None] * PAGES
                assert backend.batch_set(more, [pool.get_data_page(s) for s in starts]) is False
                assert backend.exists(keys[0]) is False
        finally:
            if fault == "stop":
                redis_server.cont()
            else:
                redis_server.restart()
        assert eventually(lambda: backend.batch_set_v1(more, indices) == [True] * PAGES)
        assert backend.batch_exists(more) == PAGES
    finally:
        backend.close()


def test_damaged_values_fail_their_pages_only_and_never_reach_the_pool_as_kv(redis_server: RedisServer) -> None:
    pool = host_pool("page_first")
    backend = attach(pool, redis_topology(redis_server.url))
    pages = 7
    keys, indices = page_keys(pages), alloc(pool, pages)
    blocks: list[list[str]] = []  # each page's Redis keys, found by writing the pages one by one
    try:
        for page in range(pages):
            before = set(redis_server.cli("--scan").split())
            one = indices[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            assert backend.batch_set_v1(keys[page : page + 1], one) == [True]
            blocks.append(sorted(set(redis_server.cli("--scan").split()) - before))
        assert all(len(b) == 2 for b in blocks)
        size = int(redis_server.cli("STRLEN", blocks[0][0]))

        redis_server.cli("SETRANGE", blocks[1][0], str(size - 7), "X")  # a payload byte changed
        redis_server.cli("SET", blocks[2][1], "truncated")  # a value cut short
        swap = ("EVAL", "local a = redis.call('GET', KEYS[1]); redis.call('SET', KEYS[1], redis.call('GET', KEYS[2]));"
                " redis.call('SET', KEYS[2], a)", "2", blocks[3][0], blocks[4][0])
        redis_server.cli(*swap)  # two pages' values exchanged: each is well formed, under the wrong key
        garbage = np.random.default_rng(4).integers(65, 91, size, dtype=np.uint8).tobytes().decode()
        redis_server.cli("SET", blocks[5][1], garbage)  # random bytes of the right length

        reader_pool = host_pool("page_first")
        scramble(reader_pool, seed=8)
        reader = attach(reader_pool, redis_topology(redis_server.url))
        targets = alloc(reader_pool, pages)
        filled = reader.batch_get_v1(keys, targets)
        assert filled == [True, False, False, False, False, False, True]
        got, wrote = page_bytes(reader_pool, targets), page_bytes(pool, indices)
        assert [got[p] == wrote[p] for p in range(pages) if filled[p]] == [True, True]
        flat = reader.batch_get(keys, [reader_pool.get_dummy_flat_data_page() for _ in keys])
        assert [page is not None for page in flat] == filled
        reader.close()
    finally:
        backend.close()


def test_indices_or_tensors_that_are_not_this_pools_pages_fail_without_raising(redis_server: RedisServer) -> None:
    pool = host_pool("page_first")
    backend = attach(pool, redis_topology(redis_server.url))
    keys, indices = page_keys(2), alloc(pool, 2)
    try:
        assert backend.batch_set_v1(keys, indices[:-1]) == [False, False]  # one index short of two pages
        assert backend.batch_get_v1(keys, indices[: PAGE_SIZE]) == [False, False]
        beyond = indices + 2 * pool.size  # past the end of the pool's buffer
        assert backend.batch_set_v1(keys, beyond) == [False, False]
        assert backend.batch_get_v1(keys, [0] * 2 * PAGE_SIZE) == [False, False]  # not a tensor
        wrong = [pool.get_data_page(0)[:-1], pool.get_data_page(0).double()]
        assert backend.batch_set(keys, wrong) is False
        assert backend.batch_get(keys, wrong) == [None, None]
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1([], indices[:0]) == [] and backend.batch_exists([]) == 0
    finally:
        backend.close()


def test_a_host_layout_without_zero_copy_page_metadata_is_refused_at_attach_naming_it(
    redis_server: RedisServer,
) -> None:
    pool = host_pool("page_unified")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(redis_topology(redis_server.url)), pool)
    with pytest.raises(UnsupportedPool, match=r"MHATokenToKVPoolHost \(page_unified\): SGLang gives no zero-copy"):
        backend.register_mem_pool_host(pool)
    assert backend.batch_exists(page_keys(1)) == 0
    backend.close()
