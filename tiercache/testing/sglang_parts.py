"""SGLang 0.5.23's own parts, built on CPU for the backend's tests and benchmarks: KV pools, storage config, factory.

The host pools are SGLang's ``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost`` over SGLang's device pools
(``device="cpu"``, unpinned: pinning needs CUDA), built the way SGLang's own storage unit tests build them;
the backend comes from ``StorageBackendFactory.create_backend("dynamic", ...)`` and gets the pool through
``register_mem_pool_host``, as ``HiCacheController.attach_storage_backend`` does; page keys are SGLang's
``get_storage_hash_str`` over token ids. Page contents are read back with SGLang's ``get_data_page``, never
with the code under test.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE_SIZE = 16
LAYERS = 4
HEADS = 2
HEAD_DIM = 32
KV_LORA_RANK = 48
ROPE_DIM = 16
DEVICE_TOKENS = 1024
HOST_RATIO = 2.0
MODEL = "org/model-a"
EVENTUALLY_S = 30.0
"""How long a test waits for something the store does in the background (replication, reconnecting)."""
POLL_S = 0.1
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKEND = {
    "backend_name": "tiercache",
    "module_path": "tiercache.integrations.sglang",
    "class_name": "TierCacheStorage",
    "interface_v1": 1,
}
"""SGLang's own keys of ``--hicache-storage-backend-extra-config`` for this backend."""


def host_pool(layout: str = "page_first", *, mla: bool = False, dtype: torch.dtype = torch.bfloat16) -> Any:
    """An SGLang host KV pool (with its device pool on CPU), its memory filled with random bytes."""
    if mla:
        device = MLATokenToKVPool(
            DEVICE_TOKENS, PAGE_SIZE, dtype, KV_LORA_RANK, ROPE_DIM, LAYERS, "cpu", False, start_layer=0,
            end_layer=LAYERS,
        )
        pool = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, HOST_RATIO, 0, PAGE_SIZE, layout, pin_memory=False,
            device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS,
        )
    else:
        device = MHATokenToKVPool(
            DEVICE_TOKENS, PAGE_SIZE, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS
        )
        pool = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, HOST_RATIO, 0, PAGE_SIZE, layout, pin_memory=False,
            device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
        )
    scramble(pool)
    return pool


def scramble(pool: Any, seed: int = 0) -> None:
    """Fill the whole host pool with random bytes (every bit pattern, NaNs included)."""
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, raw.numel(), dtype=np.uint8)))


def storage_config(
    topology: Any, *, model: str | None = MODEL, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
    page_first: bool = True, metrics: bool = False, **extra: Any,
) -> HiCacheStorageConfig:
    """SGLang's storage config of one rank, with the backend's extra config (``topology`` and ``extra``)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=page_first, model_name=model,
        extra_config={**BACKEND, "topology": topology, **extra},
    )


def attach(pool: Any, topology: Any, **config: Any) -> Any:
    """The backend as SGLang attaches it: built by the storage factory, then handed the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(topology, **config), pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_keys(pages: int, seed: int = 0) -> list[str]:
    """SGLang's storage keys (chained sha256 hex) of ``pages`` pages of a token sequence."""
    tokens = np.random.default_rng(seed).integers(0, 32000, pages * PAGE_SIZE).tolist()
    return get_storage_hash_str(tokens, None, page_size=PAGE_SIZE)


def alloc(pool: Any, pages: int) -> torch.Tensor:
    """Host indices of ``pages`` free pages (one index per token, as SGLang passes them)."""
    indices = pool.alloc(pages * PAGE_SIZE)
    assert indices is not None, "host pool full"
    return indices


def page_bytes(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes at ``host_indices``, read with SGLang's own ``get_data_page``."""
    starts = host_indices[::PAGE_SIZE].tolist()
    return [pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes() for start in starts]


def digests(pages: list[bytes]) -> list[str]:
    return [hashlib.sha256(page).hexdigest() for page in pages]


def redis_topology(*urls: str, timeout_s: float = 0.3, lookup_ms: float = 150.0, **queues: Any) -> dict:
    """A remote-only topology over Redis servers (as a mapping, as the JSON extra config may give it)."""
    tiers = [
        {"name": f"redis{i}", "type": "redis", "options": {"url": url, "timeout_s": timeout_s}}
        for i, url in enumerate(urls)
    ]
    return {"tiers": tiers, "queues": {"remote_lookup_timeout_ms": lookup_ms, **queues}}


def regional_topology(region_url: str, central_url: str, **options: Any) -> dict:
    """A remote-only topology over one region and the central store."""
    tier = {
        "name": "regional",
        "type": "regional",
        "options": {"mode": "regional", "region_url": region_url, "central_url": central_url, "timeout_s": 0.5,
                    **options},
    }
    return {"tiers": [tier], "queues": {"remote_lookup_timeout_ms": 300.0}}


def eventually(condition: Callable[[], bool], timeout_s: float = EVENTUALLY_S) -> bool:
    """Whether ``condition()`` comes true within ``timeout_s`` (asked every ``POLL_S``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(POLL_S)
    return False
