"""Remote lookups in flight, remembered per prefix between a pending answer and the engine asking again."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict

from tiercache.movement.lanes import Lane
from tiercache.movement.runtime import Runtime
from tiercache.tiers.base import Presence

MAX_PENDING_PROBES = 4096
"""Remote lookups remembered between a pending answer and the engine asking again."""


class RemoteProbes:
    """Remote lookups in flight, keyed on the exact keys asked (so prompts never share an answer)."""

    def __init__(self, lanes: list[Lane], runtime: Runtime) -> None:
        self.lanes = lanes
        self.runtime = runtime
        self._pending: OrderedDict[tuple[bytes, ...], concurrent.futures.Future[list[list[Presence]]]] = OrderedDict()

    def answer(self, keys: list[bytes]) -> list[list[Presence]] | None:
        """Per lane, each key's presence (``UNKNOWN`` where the lane failed); None while in flight."""
        probe = tuple(keys)
        future = self._pending.get(probe)
        if future is None:
            future = self.runtime.submit(self._ask(keys))
            self._pending[probe] = future
            while len(self._pending) > MAX_PENDING_PROBES:
                self._pending.popitem(last=False)
        if not future.done():
            return None
        del self._pending[probe]
        if future.cancelled() or future.exception() is not None:
            return [[Presence.UNKNOWN] * len(keys) for _ in self.lanes]
        return future.result()

    async def _ask(self, keys: list[bytes]) -> list[list[Presence]]:
        return list(await asyncio.gather(*(lane.contains(keys) for lane in self.lanes)))
