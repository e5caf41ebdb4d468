"""vLLM 0.33's real offloading classes driven the way its scheduler drives them, on CPU.

``Engine`` builds a ``TieringOffloadingSpec`` through vLLM's ``OffloadingSpecFactory``
from an ``OffloadingConfig`` (as vLLM's own ``test_tiering_offloading.py`` does), so
the tiercache tier is loaded by module path exactly as a vLLM user's
``kv_connector_extra_config`` loads it. Every manager call holds the manager's
lock; a step ends with ``on_schedule_end``; lookups follow the scheduler's
prefix loop (keep scanning past RETRY, stop at the first MISS, ask again next
step). It also runs as a script (``python -m tiercache.testing.vllm_offloading REQUEST``): the
"second process" of the tests.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

if TYPE_CHECKING:
    from tiercache.testing.redis_servers import RedisServer

KV_BYTES_PER_BLOCK = 16384
"""One worker's KV bytes per block (four pages: a row of the primary without padding)."""
NUM_CHUNKS = 32
SETTLE_S = 20.0
"""Longest a test waits for background work to settle before it fails (never a timing assertion)."""
POLL_S = 0.005
TIER_MODULE = "tiercache.integrations.vllm"


LOOKUP_TIMEOUT_MS = 150


def redis_topology(server: RedisServer, **options: Any) -> dict[str, Any]:
    """A remote-only topology over one test server (short timeouts, so failures show quickly)."""
    return {
        "tiers": [
            {
                "name": "redis",
                "type": "redis",
                "options": {"url": server.url, "allow_unbounded": True, "timeout_s": 0.3, **options},
            }
        ],
        "queues": {"remote_lookup_timeout_ms": LOOKUP_TIMEOUT_MS},
    }


def tier_config(topology: Any, **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for the tiercache tier, as a vLLM user writes it."""
    return {"type": "TierCacheTier", "module_path": TIER_MODULE, "topology": topology, **options}


def offloading_config(
    secondary_tiers: list[dict[str, Any]] | None = None,
    *,
    model: str = "test-model",
    rank: int = 0,
    tp_size: int = 1,
    num_chunks: int = NUM_CHUNKS,
    events: bool = False,
    extra: dict[str, Any] | None = None,
) -> OffloadingConfig:
    """The ``OffloadingConfig`` vLLM's connector builds, for a tiering spec with these secondary tiers."""
    extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * KV_BYTES_PER_BLOCK * tp_size,
        "secondary_tiers": secondary_tiers or [],
        **(extra or {}),
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=f"tiercache-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=65536),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def chunk_keys(count: int, prompt: str = "prompt") -> list[OffloadKey]:
    """Offload keys of a prompt's chunks (vLLM's block hash + group 0)."""
    return [make_offload_key(hashlib.sha256(f"{prompt}/{i}".encode()).digest(), 0) for i in range(count)]


def payloads(count: int, row_bytes: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, row_bytes, dtype=np.uint8).tobytes() for _ in range(count)]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Engine:
    """One vLLM instance's scheduler-side offloading manager (a real ``TieringOffloadingManager``)."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager = self.spec.get_manager()
        self.primary = self.manager.primary_tier
        self.rows = np.asarray(self.primary.get_kv_memoryview())
        self.tiers = self.manager.secondary_tiers
        self._requests = 0

    @property
    def row_bytes(self) -> int:
        return self.rows.shape[1]

    def context(self) -> ReqContext:
        self._requests += 1
        return ReqContext(req_id=f"req-{self._requests}")

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, keys: Sequence[OffloadKey], data: Sequence[bytes]) -> None:
        """A request computed these chunks: GPU -> primary (its rows written here), cascade, finish."""
        ctx = self.context()
        with self.manager.lock:
            self.manager.on_new_request(ctx)
            out = self.manager.prepare_store(list(keys), ctx)
            assert out is not None, "the primary could not take the chunks"
            by_key = dict(zip(keys, data, strict=True))
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.rows[chunk][:] = np.frombuffer(by_key[key], dtype=np.uint8)
            self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)

    def settle(self) -> None:
        """Step until the manager has no work in flight."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "the manager still has pending work"
            time.sleep(POLL_S)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> int:
        """The scheduler's prefix loop, step after step, until it has an answer: chunks HIT in a row."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            deferred, hits = False, 0
            with self.manager.lock:
                for key in keys:
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    hits += 1
                    deferred |= result is not LookupResult.HIT
            if not deferred:
                return hits
            assert time.monotonic() < deadline, "lookups stayed deferred"
            self.step()
            time.sleep(POLL_S)

    def read(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        """A request for ``keys``: look the prefix up, load what hit into 'GPU' (copies), finish."""
        ctx = self.context()
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        hits = self.lookup(keys, ctx)
        out: list[bytes | None] = [None] * len(keys)
        with self.manager.lock:
            if hits:
                spec = self.manager.prepare_load(list(keys[:hits]), ctx)
                for i, chunk in enumerate(spec.chunk_ids):
                    out[i] = self.rows[chunk].tobytes()
                self.manager.complete_load(list(keys[:hits]), ctx)
            self.manager.on_request_finished(ctx)
        return out

    def all_chunks_free(self) -> bool:
        """No leaked pins: the primary can take NUM_CHUNKS new chunks (evicting all it holds)."""
        ctx = self.context()
        with self.manager.lock:
            self.manager.on_new_request(ctx)
            out = self.manager.prepare_store(chunk_keys(self.primary._num_chunks, f"leak-check-{uuid.uuid4()}"), ctx)
            if out is not None:
                self.manager.complete_store(out.keys_to_store, ctx, success=False)
            self.manager.on_request_finished(ctx)
        return out is not None

    def shutdown(self) -> None:
        del self.rows  # the test's own view of the primary, so vLLM can unmap its region
        self.manager.shutdown()


def wait_replicated(engine: Engine, count: int) -> None:
    """Until the engine's regional tier has replicated ``count`` chunks to central (bounded, not timed)."""
    (tier,) = engine.tiers
    deadline = time.monotonic() + SETTLE_S
    while tier.store.stats()["tiers"]["regional"]["store"].get("replicated", 0) < count:
        assert time.monotonic() < deadline, "replication to central did not finish"
        time.sleep(POLL_S)


def main() -> None:
    """The second process: read chunks through a fresh spec; print their digests (None for a miss) as JSON."""
    request = json.loads(sys.argv[1])
    engine = Engine(offloading_config([tier_config(request["topology"])], **request.get("config", {})))
    try:
        found = engine.read(chunk_keys(request["count"], request["prompt"]))
        print(json.dumps([digest(data) if data is not None else None for data in found]))
    finally:
        engine.settle()
        engine.shutdown()


if __name__ == "__main__":
    main()
