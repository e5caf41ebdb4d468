"""``TierCacheStorage``: tiercache's remote tiers as SGLang's HiCache L3 storage (SGLang's ``dynamic`` backend).

What SGLang calls and what it gets:

- ``cls(storage_config, kwargs)``: the options (``options.py``) are validated and the topology loaded, so a
  bad config stops SGLang's start-up with a message naming the field.
- ``register_mem_pool_host(pool)``: the pool's pages become pieces (``pages.py``), the namespace is fixed
  (``namespace.py``) and a ``RemoteStore`` over the topology is started for blocks of one piece.
- ``batch_exists(keys)``: the matching prefix length, from one presence check of every piece and no value read; a
  page counts only when every piece is ``HELD`` (an ``UNKNOWN`` piece ends the prefix like an absent one).
- ``batch_get_v1``/``batch_set_v1(keys, host_indices)`` (``"interface_v1": 1``): pieces are read straight
  into the host pool's memory and written straight from it; a page is True only when all its pieces are.
- ``get``/``batch_get``/``set``/``batch_set``/``exists``: the same blocks through flat page tensors.
- ``clear`` deletes nothing (a shared store's pages are other instances' too); ``close`` is bounded.

Nothing on the data path raises: a store that is down, slow or returns garbage is a miss or a failed
write, and a value that fails validation never reaches the pool as KV. SGLang calls these from its
storage threads (prefetch, backup), never from the scheduler loop. Each call waits for the store's
future, which the store's lane deadlines and the tiers' socket timeouts bound, and never returns while
a tier may still touch the pool's memory (SGLang reuses it afterwards).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tiercache.integrations.sglang.namespace import model_identity, page_namespace
from tiercache.integrations.sglang.options import BackendOptions
from tiercache.integrations.sglang.pages import HostPages
from tiercache.remote.store import RemoteStore
from tiercache.tiers.base import Presence

log = logging.getLogger(__name__)

GIB = float(1 << 30)


class TierCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a tiercache remote-only topology (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options = BackendOptions.from_extra_config(storage_config.extra_config)
        self.model = model_identity(storage_config)  # refused now, not at the first page
        self.pages: HostPages | None = None
        self.store: RemoteStore | None = None
        self._metrics = _Transfers(storage_config.enable_storage_metrics)

    # -- life cycle ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Fix the namespace from the pool's layout and start the store (SGLang calls this once, at attach)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        namespace = page_namespace(self.storage_config, pages, self.model)
        store = RemoteStore(self.options.topology, namespace, pages.piece_bytes)
        store.start()
        previous, self.pages, self.store = self.store, pages, store
        if previous is not None:
            previous.close()

    def close(self) -> None:
        """Finish or drop transfers in flight (bounded) and disconnect."""
        store, self.store = self.store, None
        if store is not None:
            store.close()

    def clear(self) -> None:
        """Delete nothing: a shared store's pages belong to other SGLang instances too."""
        log.warning("tiercache: clear() deletes nothing; expire pages with the store's own ttl_s or maxmemory policy")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch), when metrics are on."""
        return self._metrics.take()

    # -- presence checks --------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages from the start are held, every piece of them (no value is read)."""
        store, pages = self.store, self.pages
        if store is None or pages is None or not keys:
            return 0
        try:
            found = store.contains(self._block_keys(pages, keys), engine_keys=True).result()
        except Exception:
            log.exception("tiercache: presence check failed; reporting no pages held")
            return 0
        held = [answer.presence is Presence.HELD for answer in found]
        return _leading_pages(held, pages.pieces, len(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy transfers (interface_v1) ----------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each page's pieces straight into the host pool at ``host_indices``."""
        return self._transfer(keys, host_indices, read=True)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Write each page's pieces straight from the host pool at ``host_indices``."""
        return self._transfer(keys, host_indices, read=False)

    def _transfer(self, keys: list[str], host_indices: torch.Tensor, *, read: bool) -> list[bool]:
        store, pages = self.store, self.pages
        if store is None or pages is None or not keys:
            return [False] * len(keys)
        try:
            views = pages.views(host_indices, len(keys))
        except Exception:  # SGLang's page metadata refusing the indices
            views = None
        if views is None:
            log.error("tiercache: the host indices given do not hold %d pages of this pool", len(keys))
            return [False] * len(keys)
        return self._move(store, pages, keys, views, read)

    # -- flat pages (batch_get / batch_set) ---------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read each page into its flat page tensor (a fresh one when none is given); None where missed."""
        store, pages = self.store, self.pages
        if store is None or pages is None or not keys:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations else [pages.pool.get_dummy_flat_data_page() for _ in keys]
        filled = self._flat(store, pages, keys, targets, read=True)
        return [target if ok else None for target, ok in zip(targets, filled, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Write each flat page tensor; True only when every page was stored."""
        store, pages = self.store, self.pages
        if store is None or pages is None or not keys or values is None or len(values) != len(keys):
            return False
        return all(self._flat(store, pages, keys, list(values), read=False))

    def _flat(
        self, store: RemoteStore, pages: HostPages, keys: list[str], tensors: list[Any], read: bool
    ) -> list[bool]:
        """Move the pages whose tensors are flat pages of this pool; the others fail."""
        usable = [(i, views) for i, views in enumerate(pages.flat_views(t) for t in tensors) if views is not None]
        if len(usable) < len(keys):
            log.error("tiercache: %d of %d tensors are not flat pages of this pool", len(keys) - len(usable), len(keys))
        moved = self._move(store, pages, [keys[i] for i, _ in usable], [v for _, vs in usable for v in vs], read)
        result = [False] * len(keys)
        for (i, _), ok in zip(usable, moved, strict=True):
            result[i] = ok
        return result

    # -- the store -----------------------------------------------------------------

    @staticmethod
    def _block_keys(pages: HostPages, keys: Sequence[str]) -> list[bytes]:
        """One block per piece: the page's key and the piece's number (the store maps them into its namespace)."""
        return [b"%s#%d" % (key.encode(), piece) for key in keys for piece in range(pages.pieces)]

    def _move(
        self, store: RemoteStore, pages: HostPages, keys: list[str], views: list[memoryview], read: bool
    ) -> list[bool]:
        """Read into or write from ``views`` (every piece of every page); per page, whether all its pieces moved."""
        if not keys:
            return []
        started = time.perf_counter()
        try:
            blocks = self._block_keys(pages, keys)
            if read:
                done = store.read(blocks, views, force_latest=self.options.force_latest, engine_keys=True).result()
            else:
                done = store.write(blocks, views, engine_keys=True).result()
        except Exception:
            log.exception("tiercache: %s of %d pages failed", "read" if read else "write", len(keys))
            return [False] * len(keys)
        per_page = [all(done[p * pages.pieces : (p + 1) * pages.pieces]) for p in range(len(keys))]
        self._metrics.record(read, sum(per_page), sum(per_page) * pages.pieces * pages.piece_bytes, started)
        return per_page


def _leading_pages(held: list[bool], pieces: int, pages: int) -> int:
    """The number of pages from the start whose pieces are all held."""
    for page in range(pages):
        if not all(held[page * pieces : (page + 1) * pieces]):
            return page
    return pages


class _Transfers:
    """Pages and GB/s per batch for SGLang's ``StorageMetrics`` (kept only when SGLang's metrics are on)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._loads: list[tuple[int, float]] = []
        self._stores: list[tuple[int, float]] = []

    def record(self, read: bool, pages: int, nbytes: int, started: float) -> None:
        if not self.enabled or pages == 0:
            return
        rate = nbytes / max(time.perf_counter() - started, 1e-9) / GIB
        with self._lock:
            (self._loads if read else self._stores).append((pages, rate))

    def take(self) -> Any:
        if not self.enabled:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            loads, stores, self._loads, self._stores = self._loads, self._stores, [], []
        return StorageMetrics(
            prefetch_pgs=[pages for pages, _ in loads],
            backup_pgs=[pages for pages, _ in stores],
            prefetch_bandwidth=[rate for _, rate in loads],
            backup_bandwidth=[rate for _, rate in stores],
        )
