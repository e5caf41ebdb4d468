"""What the bookkeeping reports as it changes what a tier holds: KV events and each tier's accesses.

The hierarchy and the load runner call one ``TierObserver`` (pure calls, cheap:
an append to a queue or a sampled hash); ``NullObserver`` is the default. The
``FleetObserver`` forwards ``stored``/``removed`` to an ``EventSink`` (vLLM-style
KV events for routers and in-process subscribers) and ``accessed`` to one
sampled miss-ratio curve per tier, read by ``stats()``.

Local tiers report exactly what they hold. A remote tier is told about from
several places (a put landed, a read served, the remote said "not held" or
reported its own eviction), so for remotes the observer keeps what it announced:
a block is announced once, and only an announced block is reported removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from tiercache.telemetry.mrc import MissRatioCurve

ANNOUNCED_PER_REMOTE = 1 << 18
"""Blocks remembered as announced per remote tier (about 40 MB at most): past it the oldest is forgotten,
and its later removal is not reported (the router keeps it until that engine's next ``AllBlocksCleared``)."""


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
    """Events to an ``EventSink`` (when one is given), accesses to per-tier miss-ratio curves.

    ``remotes``: the remote tiers' names, whose announced blocks are remembered
    (the ``ANNOUNCED_PER_REMOTE`` most recent per tier).
    """

    def __init__(
        self,
        sink: Any | None,
        curves: dict[str, MissRatioCurve],
        block_size: int,
        lora_id: int | None,
        remotes: Sequence[str] = (),
    ) -> None:
        self.sink = sink
        self.curves = curves
        self.block_size = block_size
        self.lora_id = lora_id
        self._announced: dict[str, OrderedDict[bytes, None]] = (
            {name: OrderedDict() for name in remotes} if sink is not None else {}
        )

    def stored(self, tier: str, keys: Sequence[bytes], parent: bytes | None, tokens: Sequence[int] | None) -> None:
        if self.sink is None or not keys:
            return
        announced = self._announced.get(tier)
        if announced is not None:
            fresh = [key for key in keys if key not in announced]
            for key in keys:
                announced[key] = None
                announced.move_to_end(key)  # the least recently stored are forgotten first
            keys = fresh
            while len(announced) > ANNOUNCED_PER_REMOTE:
                announced.popitem(last=False)
            if not keys:
                return
        self.sink.stored(tier, list(keys), parent, tokens, self.block_size, self.lora_id)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if self.sink is None or not keys:
            return
        announced = self._announced.get(tier)
        if announced is not None:
            keys = [key for key in keys if announced.pop(key, False) is None]
        if keys:
            self.sink.removed(tier, list(keys))

    def accessed(self, tier: str, keys: Sequence[bytes]) -> None:
        curve = self.curves.get(tier)
        if curve is not None and keys:
            curve.access_many(keys)


def report_stored_runs(
    observer: TierObserver, tier: str, keys: Sequence[bytes], fresh: set[bytes], tokens: Sequence[int] | None,
    block_size: int,
) -> None:
    """One ``stored`` per run of ``fresh`` blocks among a chain's ``keys``, with its parent and its tokens."""
    if not fresh or isinstance(observer, NullObserver):
        return
    start = None
    for position in range(len(keys) + 1):
        inside = position < len(keys) and keys[position] in fresh
        if inside and start is None:
            start = position
        elif not inside and start is not None:
            parent = keys[start - 1] if start else None
            run = None if tokens is None else [int(t) for t in tokens[start * block_size : position * block_size]]
            observer.stored(tier, keys[start:position], parent, run)
            start = None
