"""What the bookkeeping reports as it changes what a tier holds: KV events and each tier's accesses.

The hierarchy and the load runner call one ``TierObserver`` (pure calls, cheap:
an append to a queue or a sampled hash); ``NullObserver`` is the default. The
``FleetObserver`` forwards ``stored``/``removed`` to an ``EventSink`` (vLLM-style
KV events for routers and in-process subscribers) and ``accessed`` to one
sampled miss-ratio curve per tier, read by ``stats()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tiercache.mrc import MissRatioCurve


class TierObserver(Protocol):
    """Told of every change of what a tier holds, and of every access a tier's policy sees."""

    def stored(
        self, tier: str, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None
    ) -> None: ...

    def removed(self, tier: str, keys: Sequence[bytes]) -> None: ...

    def accessed(self, tier: str, keys: Sequence[bytes]) -> None: ...


class NullObserver:
    """Observes nothing (events and curves off)."""

    def stored(self, tier: str, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None) -> None:
        return None

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        return None

    def accessed(self, tier: str, keys: Sequence[bytes]) -> None:
        return None


class FleetObserver:
    """Events to an ``EventSink`` (when one is given), accesses to per-tier miss-ratio curves."""

    def __init__(
        self, sink: Any | None, curves: dict[str, MissRatioCurve], block_size: int, lora_id: int | None
    ) -> None:
        self.sink = sink
        self.curves = curves
        self.block_size = block_size
        self.lora_id = lora_id

    def stored(self, tier: str, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None) -> None:
        if self.sink is not None and keys:
            self.sink.stored(tier, list(keys), parent, tokens, self.block_size, self.lora_id)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if self.sink is not None and keys:
            self.sink.removed(tier, list(keys))

    def accessed(self, tier: str, keys: Sequence[bytes]) -> None:
        curve = self.curves.get(tier)
        if curve is not None and keys:
            curve.access_many(keys)
