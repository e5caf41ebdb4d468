"""A remote tier that lives outside tiercache, loaded by module path (``type: support.plugin_tier:DictTier``).

Its own file and nothing else: ``DictTier`` keeps blocks in a process-wide dict
named by its ``store`` option (``down: true`` makes it unreachable). The
``RemoteTier`` base does the rest of the contract for it: it judges the values
a read found invalid and removes the damaged ones (through ``delete``), keeps
``last_error`` and adds the contract's counters to ``stats()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.blocks.value_format import DecodeStatus
from tiercache.tiers.base import Presence, RemoteContext, RemoteTier

STORES: dict[str, dict[bytes, bytes]] = {}
"""The dicts tiers share, by ``store`` name."""


@dataclass(frozen=True)
class DictOptions:
    """``store``: tiers naming the same store share it. ``down``: every call fails (unreachable)."""

    store: str = "default"
    down: bool = False

    def __post_init__(self) -> None:
        if not self.store:
            raise ValueError("store must be a non-empty name")


class DictTier(RemoteTier):
    """Blocks in a dict; values in the codec's format, validated on every read."""

    Options = DictOptions

    def __init__(self, context: RemoteContext, options: DictOptions) -> None:
        super().__init__(context, options)
        self.data = STORES.setdefault(options.store, {})
        self.counts: Counter = Counter()

    def _reachable(self, op: str) -> bool:
        if self.options.down:
            self.note_error(f"{op}: store {self.options.store!r} is down")
        return not self.options.down

    async def contains(self, keys: Sequence[bytes]) -> list[Presence]:
        if not self._reachable("contains"):
            return [Presence.UNKNOWN] * len(keys)
        return [Presence.of(key in self.data) for key in keys]

    async def get_into(
        self, keys: Sequence[bytes], dests: Sequence[memoryview], *, force_latest: bool = False
    ) -> list[bool]:
        results = [False] * len(keys)
        invalid: list[tuple[bytes, DecodeStatus]] = []
        if self._reachable("get"):
            for index, (key, dest) in enumerate(zip(keys, dests, strict=True)):
                value = self.data.get(key)
                if value is not None:
                    status = self.codec.decode_into(key, value, dest).status
                    results[index] = status is DecodeStatus.OK
                    if status is not DecodeStatus.OK:
                        invalid.append((key, status))
        self.invalid_values.report(invalid)
        hits = sum(results)
        self.counts["hits"] += hits
        self.counts["misses"] += len(keys) - hits
        self.counts["bytes_read"] += hits * self.block_bytes
        return results

    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        if not self._reachable("put"):
            return [False] * len(keys)
        for key, payload in zip(keys, payloads, strict=True):
            value = self.codec.encode_value(key, payload)
            self.data[key] = value
            self.counts["bytes_written"] += len(value)
        return [True] * len(keys)

    async def delete(self, keys: Sequence[bytes]) -> None:
        if self._reachable("delete"):
            for key in keys:
                self.data.pop(key, None)

    def tier_stats(self) -> dict[str, float]:
        return {name: float(self.counts[name]) for name in ("hits", "misses", "bytes_read", "bytes_written")}
