"""One rule for "same model" through SGLang's HiCache backend (SGLang 0.5.23's own classes, real Redis).

In a server, SGLang publishes its model settings (``--model-path``, ``--revision``, ``--dtype``,
``--quantization``); the backend identifies the checkpoint they name by content. Each case publishes them
with SGLang's own ``override_server_args`` and attaches backends as SGLang does: a fine-tune saved over
the same path under the same served name, and another model in a directory of the same name, find none of
the first's pages; the checkpoint copied elsewhere, or served again, finds them all. Without published
settings, ``HiCacheStorageConfig.model_name`` is taken as the checkpoint when it names one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sglang.srt.runtime_context import get_context
from support.checkpoints import copy_checkpoint, write_checkpoint, write_weights

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.sglang_parts import alloc, attach, host_pool, page_keys, redis_topology

PAGES = 4
SERVED_NAME = "chat-model"


@contextmanager
def serving(model: Path, **settings: object) -> Iterator[None]:
    """SGLang's published server settings for ``model`` under one served name, while the backend is built."""
    with get_context().override_server_args(model_path=str(model), served_model_name=SERVED_NAME, **settings):
        yield


@contextmanager
def backend(server: RedisServer, served: Path | None = None, **config: object) -> Iterator[tuple[Any, Any]]:
    """A fresh pool and backend, attached while ``served`` is served (``served=None``: nothing published)."""
    pool = host_pool()
    if served is None:
        attached = attach(pool, redis_topology(server.url), **config)
    else:
        with serving(served):
            attached = attach(pool, redis_topology(server.url), model=SERVED_NAME)
    try:
        yield pool, attached
    finally:
        attached.close()


def found(server: RedisServer, keys: list[str], served: Path | None = None, **config: object) -> int:
    """Pages a backend of an SGLang serving ``served`` finds."""
    with backend(server, served, **config) as (_, reader):
        return reader.batch_exists(keys)


def stored(server: RedisServer, served: Path | None = None, **config: object) -> list[str]:
    """Keys of ``PAGES`` pages written by a backend of an SGLang serving ``served``."""
    keys = page_keys(PAGES, seed=11)
    with backend(server, served, **config) as (pool, writer):
        assert writer.batch_set_v1(keys, alloc(pool, PAGES)) == [True] * PAGES
    return keys


def test_a_fine_tune_saved_over_the_same_path_under_the_same_name_finds_nothing(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = write_checkpoint(tmp_path / "served" / "model", seed=0)
    keys = stored(redis_server, path)
    write_weights(path, seed=1)
    assert found(redis_server, keys, path) == 0
    write_weights(path, seed=0)
    assert found(redis_server, keys, path) == PAGES


def test_directories_of_one_name_stay_apart_and_a_copy_shares(redis_server: RedisServer, tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "team-a" / "model", seed=0)
    keys = stored(redis_server, path)
    assert found(redis_server, keys, write_checkpoint(tmp_path / "team-b" / "model", seed=1)) == 0
    assert found(redis_server, keys, copy_checkpoint(path, tmp_path / "elsewhere" / "renamed")) == PAGES
    assert found(redis_server, keys, path) == PAGES


def test_settings_that_change_kv_count(redis_server: RedisServer, tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "model", seed=0)
    keys = stored(redis_server, path)
    with serving(path, quantization="fp8"):
        quantized = attach(host_pool(), redis_topology(redis_server.url), model=SERVED_NAME)
    try:
        assert quantized.batch_exists(keys) == 0
    finally:
        quantized.close()


def test_without_published_settings_a_model_name_that_is_a_checkpoint_is_digested(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = write_checkpoint(tmp_path / "model", seed=0)
    keys = stored(redis_server, model=str(path))
    write_weights(path, seed=1)
    assert found(redis_server, keys, model=str(path)) == 0
    copy = copy_checkpoint(write_weights(path, seed=0), tmp_path / "copy")
    assert found(redis_server, keys, model=str(copy)) == PAGES
