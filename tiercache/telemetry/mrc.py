"""Live miss-ratio curves: "what hit ratio would this tier have with 0.25x .. 4x its blocks?".

SHARDS (Waldspurger et al., FAST'15): spatially sample the keys a tier sees
(a key is in the sample iff its hash is below a threshold T, so every access of
a sampled key is seen and none of an unsampled one), measure each sampled
access's LRU reuse distance *within the sample* (distinct sampled keys touched
since that key's previous access), and scale it by 1/R, R = T / 2**64. The
histogram of scaled distances is the LRU miss-ratio curve of the whole stream.
Two variants: a fixed sample size, the default (SHARDS's bounded memory: the
rate starts at 1, and when more than ``max_samples`` keys are tracked, T drops
to the largest tracked hash and that key leaves the sample), and a fixed rate.
The default is exact while a tier sees fewer than ``max_samples`` distinct keys,
so small tiers get their curve right, and tracks at most that many, so the
memory and the cost per access stay bounded (O(log max_samples) for a sampled
access) however many keys a tier sees. A fixed rate of 0.01 is off by 4-27
points at 0.25x-4x of a 256- to 4096-block tier seeing 20K-60K keys, where the
default is within about 3 (benchmarks/mrc.py). Each sampled access weighs 1/R
at the rate in force when it was seen, and the difference between the number of
accesses and the sampled weight goes to the distance-0 bucket (SHARDS-adj),
which corrects the bias a few sampled heavy hitters would otherwise cause.

The spatial hash is the key's first 8 bytes read big-endian, XORed with a mask
derived from ``seed`` (a bijection, so each seed samples a different, equally
uniform set of keys). tiercache's keys are BLAKE2b digests (tiercache.blocks.keys), so
those bytes are already uniform and nothing is hashed again. Accesses are
buffered and filtered in bulk (one join and one vectorised compare per flush,
which comes once about ``FLUSH_SAMPLES`` accesses are expected to be sampled, or
after ``flush_keys``), so an unsampled access costs tens of nanoseconds in C
(mostly touching the key object) instead of a Python step, a sampled one a few
microseconds (sortedcontainers' order statistics), and no flush holds the
caller for long. Feed whole requests (``access_many``): one call per key costs
a Python call per key. benchmarks/mrc.py measures the cost against the LRU
policy's decision.

The curve is LRU's; for another policy it is the usual sizing estimate, not that
policy's exact curve. Pure: no threads, no I/O; not thread-safe (call it from
the thread that drives the tier's policy).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
from sortedcontainers import SortedList

from tiercache.blocks.keys import KEY_BYTES

HASH_BYTES = 8
"""Bytes of the key read as its spatial hash (big-endian), the space SHARDS samples from."""
HASH_SPACE = 1 << (8 * HASH_BYTES)
"""Number of distinct spatial hashes; the sample rate is threshold / HASH_SPACE."""
DEFAULT_SAMPLE_RATE = 1.0
"""The starting rate of the default, fixed-size sample: every key until ``DEFAULT_MAX_SAMPLES`` are tracked."""
DEFAULT_MAX_SAMPLES = 16_000
"""Keys tracked at most per tier by default: within about 2 points of exact LRU at 0.25x-4x of 1024-block
and larger tiers on Zipf 0.8-1.0 and scan-mixed traces (3 at 256 blocks), some megabytes per tier."""
DEFAULT_FLUSH_KEYS = 4096
"""Buffered accesses filtered in one bulk pass at most: large enough that the per-pass overhead
(a numpy call, a join) is under a nanosecond per key, small enough to stay in cache."""
FLUSH_SAMPLES = 256
"""Expected sampled accesses per flush: a flush then takes about a millisecond whatever the rate."""
DEFAULT_MULTIPLES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
"""Capacities, as multiples of the tier's, at which ``curve`` answers by default."""
_BIG_ENDIAN_U64 = np.dtype(">u8")


@dataclass(frozen=True)
class MrcConfig:
    """The ``mrc`` section of a topology: a live miss-ratio curve per tier in ``stats()`` (off by default)."""

    enabled: bool = False
    sample_rate: float = DEFAULT_SAMPLE_RATE
    """The starting rate of the fixed-size sample (or, with ``max_samples: null``, the fixed rate)."""
    max_samples: int | None = DEFAULT_MAX_SAMPLES
    """Keys tracked at most per tier (fixed-size SHARDS); None: a fixed rate, memory unbounded."""

    def __post_init__(self) -> None:
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate: expected a number in (0, 1], got {self.sample_rate!r}")
        if self.max_samples is not None and self.max_samples <= 0:
            raise ValueError(f"max_samples: expected an integer > 0, got {self.max_samples!r}")


class MissRatioCurve:
    """A SHARDS-sampled LRU reuse-distance histogram of one tier's access stream."""

    def __init__(
        self,
        sample_rate: float = DEFAULT_SAMPLE_RATE,
        max_samples: int | None = DEFAULT_MAX_SAMPLES,
        key_bytes: int = KEY_BYTES,
        flush_keys: int = DEFAULT_FLUSH_KEYS,
        seed: int = 0,
    ) -> None:
        """``sample_rate`` is the starting (highest) rate of a fixed-size sample, or with ``max_samples=None``
        the fixed rate.

        ``seed`` picks which keys are sampled; two seeds give two independent estimates.
        """
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if max_samples is not None and max_samples <= 0:
            raise ValueError(f"max_samples must be positive, got {max_samples}")
        if key_bytes < HASH_BYTES:
            raise ValueError(f"key_bytes must be at least {HASH_BYTES}, got {key_bytes}")
        if flush_keys <= 0:
            raise ValueError(f"flush_keys must be positive, got {flush_keys}")
        self.max_samples = max_samples
        self.key_bytes = key_bytes
        self.flush_keys = flush_keys
        self._threshold = max(1, round(sample_rate * HASH_SPACE))
        self._mask = int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "big"), digest_size=HASH_BYTES).digest(), "big")
        self._pending: list[Sequence[bytes]] = []
        self._pending_keys = 0
        self._flush_at = self._flush_size()
        self._accesses = 0
        self._sampled = 0
        self._clock = 0
        self._last_access: dict[bytes, int] = {}
        self._times: SortedList = SortedList()
        self._largest: list[tuple[int, bytes]] = []  # max-heap of tracked (-hash, key), fixed-size only
        self._cold_weight = 0.0
        self._distances: defaultdict[int, float] = defaultdict(float)

    @property
    def sample_rate(self) -> float:
        """The rate in force now (it only falls, in the fixed-size variant)."""
        return self._threshold / HASH_SPACE

    def access(self, key: bytes) -> None:
        """Record one access of ``key`` (a hit or a miss alike)."""
        self.access_many((key,))

    def access_many(self, keys: Sequence[bytes]) -> None:
        """Record accesses of ``keys``, in order; the sequence is kept until the next flush, unchanged."""
        if not keys:
            return
        self._pending.append(keys)
        self._pending_keys += len(keys)
        if self._pending_keys >= self._flush_at:
            self.flush()

    def _flush_size(self) -> int:
        """Buffered accesses per flush: about ``FLUSH_SAMPLES`` sampled ones, at most ``flush_keys``."""
        return max(1, min(self.flush_keys, math.ceil(FLUSH_SAMPLES * HASH_SPACE / self._threshold)))

    def flush(self) -> None:
        """Filter the buffered accesses and account the sampled ones (``curve`` calls it)."""
        if not self._pending:
            return
        batches, self._pending = self._pending, []
        self._accesses += self._pending_keys
        self._pending_keys = 0
        keys = batches[0] if len(batches) == 1 else list(chain.from_iterable(batches))
        for index, spatial_hash in self._candidates(keys):
            if spatial_hash < self._threshold:  # the threshold may have dropped during this pass
                self._record(keys[index], spatial_hash)
        self._flush_at = self._flush_size()

    def _candidates(self, keys: Sequence[bytes]) -> Iterable[tuple[int, int]]:
        """(index, hash) of every key whose hash is below the threshold, in order, found in bulk."""
        joined = b"".join(keys)
        if len(joined) != len(keys) * self.key_bytes:  # keys of another length: the slow, exact path
            spatial = ((i, int.from_bytes(key[:HASH_BYTES], "big") ^ self._mask) for i, key in enumerate(keys))
            return [(i, h) for i, h in spatial if h < self._threshold]
        prefixes = np.ndarray((len(keys),), dtype=_BIG_ENDIAN_U64, buffer=joined, strides=(self.key_bytes,))
        hashes = prefixes ^ np.uint64(self._mask)
        below = np.flatnonzero(hashes <= np.uint64(self._threshold - 1))
        return zip(below.tolist(), hashes[below].tolist(), strict=True)

    def _record(self, key: bytes, spatial_hash: int) -> None:
        """One sampled access: its reuse distance within the sample, scaled to the whole stream."""
        weight = HASH_SPACE / self._threshold  # 1 / rate: the accesses this one stands for
        self._sampled += 1
        now = self._clock
        self._clock += 1
        times = self._times
        previous = self._last_access.get(key)
        self._last_access[key] = now
        if previous is None:
            self._cold_weight += weight
            times.add(now)
            if self.max_samples is not None:
                heapq.heappush(self._largest, (-spatial_hash, key))
                if len(self._last_access) > self.max_samples:
                    self._lower_threshold()
            return
        distinct_since = len(times) - times.bisect_right(previous)
        self._distances[int(distinct_since * weight)] += weight
        times.remove(previous)
        times.add(now)

    def _lower_threshold(self) -> None:
        """Fixed-size SHARDS: drop the tracked key(s) with the largest hash; it becomes the threshold."""
        negative_hash, _ = self._largest[0]
        self._threshold = -negative_hash
        while self._largest and -self._largest[0][0] >= self._threshold:
            _, key = heapq.heappop(self._largest)
            self._times.remove(self._last_access.pop(key))

    def hit_ratio(self, capacity: float) -> float:
        """Estimated LRU hit ratio of the stream so far with room for ``capacity`` blocks."""
        return self.curve(capacity, (1.0,))[1.0]

    def curve(self, capacity: float, multiples: Sequence[float] = DEFAULT_MULTIPLES) -> dict[float, float]:
        """Estimated LRU hit ratio at ``capacity * m`` blocks, for each multiple ``m``.

        0.0 everywhere before any access; each value is in [0, 1] and never falls as the size grows.
        """
        self.flush()
        if not self._accesses:
            return {m: 0.0 for m in multiples}
        distances = sorted(self._distances.items())
        bounds = np.array([d for d, _ in distances], dtype=np.float64)
        cumulative = np.cumsum([w for _, w in distances]) if distances else np.zeros(0)
        sampled_weight = self._cold_weight + (float(cumulative[-1]) if distances else 0.0)
        adjustment = self._accesses - sampled_weight  # SHARDS-adj: the sampling error, put at distance 0
        result: dict[float, float] = {}
        for m in multiples:
            size = capacity * m
            if size <= 0:
                result[m] = 0.0
                continue
            count = int(np.searchsorted(bounds, size, side="left"))  # distances < size hit
            hits = (float(cumulative[count - 1]) if count else 0.0) + adjustment
            result[m] = min(1.0, max(0.0, hits / self._accesses))
        return result

    def summary(self, capacity: float, multiples: Sequence[float] = DEFAULT_MULTIPLES) -> dict[str, object]:
        """What stats() shows per tier: hit ratio per capacity multiple (keys like "0.25"), and the sampling."""
        curve = self.curve(capacity, multiples)
        return {
            "capacity_blocks": capacity,
            "hit_ratio": {f"{m:g}": ratio for m, ratio in curve.items()},
            **self.stats(),
        }

    def stats(self) -> dict[str, float | int]:
        """Accesses seen, sampled accesses, keys tracked and the rate in force (for stats() and metrics)."""
        self.flush()
        return {
            "accesses": self._accesses,
            "sampled_accesses": self._sampled,
            "tracked_keys": len(self._last_access),
            "sample_rate": self.sample_rate,
        }
