"""tiercache's eviction policies as vLLM ``CachePolicy`` classes for vLLM's CPU offloading tier.

vLLM 0.33 ships LRU and ARC; these add scan-resistant S3-FIFO and 2Q (and
tiercache's LRU and ARC, which make libCacheSim's decisions). A vLLM user picks
one with two keys of ``kv_connector_extra_config``::

    "eviction_policy": "TierCacheS3FIFO",
    "cache_policy_module_path": "tiercache.integrations.vllm"

How vLLM's CPU manager drives a policy maps onto tiercache's few operations,
addressed by key (``KeyedPolicy`` in ``policies/keyed.py``, libCacheSim's loop), like this:

- a store miss (``on_store_miss``) is a miss access (``access`` returning
  False: ARC and S3-FIFO learn from their ghosts here), then ``evict`` makes room
  (the missed key is the ``incoming`` key ARC's REPLACE needs) and ``insert``
  admits the key;
- a reuse counts once per request, when the request finishes
  (``on_request_finished``: the keys it loaded, tail first, so a prefix's head
  stays longest), never per lookup; ``touch`` is an access of resident keys;
- ``evict(n, protected)`` steps over pinned and protected chunks and is atomic:
  it checks that n chunks can go before the policy evicts any.

Replaying a trace through vLLM's ``CPUOffloadingManager`` therefore gives
libCacheSim's hits (``tests/engines/vllm/test_vllm_policies.py``).
"""

# ruff: noqa: E402 - vLLM is imported after the version check below
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from tiercache.integrations.vllm.version import TIERING_SERIES, require_vllm

require_vllm(TIERING_SERIES, "tiercache's vLLM CPU-tier policies")

from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from tiercache.policies import KeyedPolicy, keyed_policy


class TierCachePolicy(CachePolicy):
    """A tiercache ``EvictionPolicy`` behind vLLM's ``CachePolicy`` (see the module docstring)."""

    policy_name: ClassVar[str]
    """The name of the tiercache policy (``tiercache.policies.POLICIES``)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._evictable: set[OffloadKey] = set()
        self._policy: KeyedPolicy = self._new_policy()
        self._missed: dict[OffloadKey, None] = {}
        """Keys whose miss the policy has seen and that are not inserted yet, in order."""

    def _new_policy(self) -> KeyedPolicy:
        return keyed_policy(self.policy_name, max(1, self.cache_capacity))

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    @override
    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._missed = {}
        for key in keys:
            if key not in self.chunks and key not in self._missed:
                self._policy.access(key)
                self._missed[key] = None

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        if self._missed.pop(key, False) is False:
            self._policy.access(key)  # a miss the manager did not announce (a promotion into the tier)
        self.chunks[key] = chunk
        self._policy.insert(key)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)

    @override
    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._evictable.discard(key)
        self._policy.remove(key)

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            if key in self.chunks:
                self._policy.access(key)

    @override
    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in reused_keys and key in self.chunks:
                self._policy.access(key)

    @override
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        evictable = self._evictable
        if len(evictable) - sum(1 for key in protected if key in evictable) < n:
            return None

        def can_evict(key: object) -> bool:
            return key in evictable and key not in protected

        incoming = iter(self._missed)
        victims: list[tuple[OffloadKey, ChunkStatus]] = []
        for _ in range(n):
            key = self._policy.evict(can_evict, incoming=next(incoming, None))
            evictable.discard(key)
            victims.append((key, self.chunks.pop(key)))
        return victims

    @override
    def clear(self) -> None:
        self.chunks.clear()
        self._evictable.clear()
        self._missed = {}
        self._policy = self._new_policy()

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)


class TierCacheLRU(TierCachePolicy):
    """Least recently used (libCacheSim's LRU)."""

    policy_name = "lru"


class TierCacheARC(TierCachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha; libCacheSim's ARC)."""

    policy_name = "arc"


class TierCacheS3FIFO(TierCachePolicy):
    """S3-FIFO (Yang et al., SOSP '23): scans pass through a small FIFO without flushing the main one."""

    policy_name = "s3fifo"


class TierCache2Q(TierCachePolicy):
    """2Q (Johnson & Shasha): a FIFO for first accesses, an LRU for keys seen again."""

    policy_name = "twoq"
