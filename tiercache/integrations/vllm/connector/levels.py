"""The blocks the remote tiers served at each codec level, as counts for vLLM's stats (``level_blocks:<level>``).

A remote tier with a lossy ``codec`` counts per level the blocks its reads
filled (exact, int8, compact), and ``LowerTiers.level_blocks`` reads them out;
this turns them into the counts since vLLM last took them, so ``/metrics`` shows
``vllm:tiercache_level_blocks_total{level="int8"}`` beside the blocks loaded.
Tiers without a lossy level count nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

LEVEL_SEPARATOR = ":"
"""``level_blocks:<level>`` (a ``level`` label in Prometheus)."""


class LevelReads:
    """Per level, the blocks the coded remote tiers served since the last ``take`` (``served``: the running
    counts, as ``LowerTiers.level_blocks``)."""

    def __init__(self, served: Callable[[], Mapping[str, int]]) -> None:
        self._served = served
        self._seen: dict[str, int] = {}

    def take(self) -> dict[str, int]:
        """``level_blocks:<level>`` -> blocks served since the last call (only levels that served any)."""
        now = self._served()
        fresh = {f"level_blocks{LEVEL_SEPARATOR}{level}": count - self._seen.get(level, 0)
                 for level, count in now.items() if count > self._seen.get(level, 0)}
        self._seen = dict(now)
        return fresh
