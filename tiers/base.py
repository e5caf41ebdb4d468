"""The interface of tiers below the pinned-CPU swap space (Redis, files, simulated, regional).

A remote tier is a key-value store of whole blocks. Its methods are coroutines
that never block the event loop and never raise on the data path: a failure of
any kind (refused, timed out, garbage, wrong namespace) is reported as a miss, a
failed write or an unknown presence in the returned list and counted in ``stats()``. Values carry the
``tiercache.codec`` header; a read validates it before copying into ``dests``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tiercache.codec import Codec


class Presence(enum.Enum):
    """Whether a remote tier holds a key: three answers, because "could not tell" is not "not held"."""

    HELD = "held"
    ABSENT = "absent"
    """The tier answered, and does not hold the key."""
    UNKNOWN = "unknown"
    """No answer (timeout, breaker open, connection error, garbage): neither a hit nor evidence of removal."""

    @staticmethod
    def of(held: bool) -> Presence:
        """The answer of a tier that did reply."""
        return Presence.HELD if held else Presence.ABSENT


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do, so the manager need not special-case tier types."""

    shared: bool = True
    """Other engines (processes, hosts) see what this tier stores."""
    versioned: bool = False
    """Reads honour ``force_latest`` against a central version."""
    persistent: bool = False
    """Entries survive a restart of the store."""


@dataclass(frozen=True)
class RemoteContext:
    """What every remote tier is built with besides its own options."""

    name: str
    codec: Codec
    block_bytes: int


class RemoteTier(ABC):
    """A block store addressed by key; async, batched, failures as values."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type]
    """Dataclass of this tier's YAML ``options``; config validation fills it."""

    def __init__(self, context: RemoteContext, options: Any) -> None:
        self.name = context.name
        self.codec = context.codec
        self.block_bytes = context.block_bytes
        self.options = options

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect or prepare; an unreachable store is not an error (it reads as misses)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and background tasks."""

    @abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        """Whether each key is stored; ``Presence.UNKNOWN`` where a failure kept the tier from telling."""

    @abstractmethod
    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        """Read and validate each key into its ``dests`` buffer; True where it was filled.

        A False entry leaves its buffer in an unspecified state; the caller must not
        use it.
        """

    @abstractmethod
    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        """Store each payload (the caller keeps the buffers alive until this returns)."""

    @abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove keys; missing keys and failures are ignored."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters: hits, misses, errors by kind, bytes read/written, breaker state."""
