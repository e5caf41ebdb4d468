"""What a tier's tests give the conformance suite: tiers over one store, and raw access to that store.

The suite judges a tier from outside, so it needs what only the tier's author
knows: how to open a tier over a shared store (and over one that is not
there), and how to read and write the bytes the store holds under a block key,
to damage a value or plant one the reader must leave alone. Everything else
(keys, payloads, codecs, the checks) is the suite's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from tiercache.blocks.codec import Codec
from tiercache.tiers.base import RemoteTier

T = TypeVar("T")
FINGERPRINT = b"conformance-ns-1"
"""The namespace the suite's tiers write in."""
OTHER_FINGERPRINT = b"conformance-ns-2"
"""Another namespace, whose values a reader must leave alone."""
SECRET = b"conformance secret, 32 bytes...."
"""The writer's namespace secret in the keyed checks."""
OTHER_SECRET = b"a co-tenant's other secret......"
"""A secret that is not the writer's."""
DEFAULT_BLOCK_BYTES = 4096
DEFAULT_CLOSE_BOUND_S = 10.0
"""How long ``close`` may take before the suite calls it hung (a failure detector, not a speed target)."""
DEFAULT_CALL_BOUND_S = 30.0
"""How long one data-path call may take before the suite calls it hung (ditto)."""


class StoreHarness(ABC):
    """A tier's test support for the conformance suite (see the module docstring).

    Every tier ``open`` returns shares one store: what one writes, a tier opened
    afterwards reads. ``read_raw``/``write_raw`` see the bytes of a block key as
    a reader of that store would (a tier with several stores, such as a region
    and a central, writes all of them and reads the one read first).
    """

    block_bytes: int = DEFAULT_BLOCK_BYTES
    close_bound_s: float = DEFAULT_CLOSE_BOUND_S
    call_bound_s: float = DEFAULT_CALL_BOUND_S
    copies: int = 1
    """Stores ``write_raw`` writes (and a read then judges, and counts, one by one): 2 for a region + central."""
    queues_writes: bool = False
    """The tier acknowledges a write it queued for a store it cannot reach yet (a region replicating to a
    central): with the store unreachable, its ``put`` may answer True."""

    @abstractmethod
    async def open(self, codec: Codec) -> RemoteTier:
        """A started tier over the shared store, with values in ``codec``'s namespace."""

    @abstractmethod
    async def open_unreachable(self, codec: Codec) -> RemoteTier:
        """A started tier whose store cannot be reached (refused, down, unusable)."""

    @abstractmethod
    async def read_raw(self, key: bytes) -> bytes | None:
        """The value the store holds for ``key`` (header and payload), or None."""

    @abstractmethod
    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Store ``value`` as the value of ``key``, bypassing every check."""

    async def settle(self, tier: RemoteTier) -> None:
        """Wait for a tier's background work to land (removals; a tier that replicates also that)."""
        await tier.settle()


@dataclass(frozen=True)
class Blocks:
    """Keys and payloads the suite writes (random, reproducible)."""

    keys: list[bytes]
    payloads: list[bytes]

    @classmethod
    def make(cls, count: int, block_bytes: int, seed: int) -> Blocks:
        rng = random.Random(seed)
        keys = [rng.randbytes(16) for _ in range(count)]
        return cls(keys, [rng.randbytes(block_bytes) for _ in keys])

    def views(self) -> list[memoryview]:
        return [memoryview(payload) for payload in self.payloads]


def buffers(count: int, block_bytes: int) -> list[memoryview]:
    """Destination buffers, as pinned-CPU slots would be."""
    return [memoryview(bytearray(block_bytes)) for _ in range(count)]


@contextlib.asynccontextmanager
async def opened(harness: StoreHarness, codec: Codec, *, reachable: bool = True) -> AsyncIterator[RemoteTier]:
    """A tier from ``harness``, closed (within the harness's bound) when the block ends."""
    tier = await bounded(harness, harness.open(codec) if reachable else harness.open_unreachable(codec))
    try:
        yield tier
    finally:
        await asyncio.wait_for(tier.close(), harness.close_bound_s)


async def bounded(harness: StoreHarness, call: Awaitable[T]) -> T:
    """Await ``call`` within the harness's bound for one call (a hang fails the check instead of the run)."""
    return await asyncio.wait_for(call, harness.call_bound_s)


def namespace(secret: bytes | None = None, fingerprint: bytes = FINGERPRINT) -> Codec:
    """A codec of the suite's namespace (or another), keyed with ``secret`` when given."""
    return Codec(fingerprint, secret=secret)
