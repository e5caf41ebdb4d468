"""The blocks the remote tiers served at each codec level, as counts for vLLM's stats (``level_blocks:<level>``).

A remote tier with a lossy ``codec`` (``tiercache.tiers.coded.CodedTier``) counts
per level the blocks its reads filled (``LevelChooser.counters``: exact, int8,
compact); this turns them into the counts since vLLM last took them, so
``/metrics`` shows ``vllm:tiercache_level_blocks_total{level="int8"}`` beside
the blocks loaded. Tiers without a lossy level count nothing here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tiercache.tiers.base import RemoteTier
from tiercache.tiers.coded import CodedTier

LEVEL_SEPARATOR = ":"
"""``level_blocks:<level>`` (a ``level`` label in Prometheus)."""


class LevelReads:
    """Per level, the blocks the coded remote tiers served since the last ``take``."""

    def __init__(self, remotes: Iterable[RemoteTier]) -> None:
        self._coded = [tier for tier in remotes if isinstance(tier, CodedTier)]
        self._seen: Counter[str] = Counter()

    def take(self) -> dict[str, int]:
        """``level_blocks:<level>`` -> blocks served since the last call (only levels that served any)."""
        if not self._coded:
            return {}
        now: Counter[str] = Counter()
        for tier in self._coded:
            for level, counters in list(tier.chooser.counters.items()):  # the tiers' loop thread adds levels
                now[f"level_blocks{LEVEL_SEPARATOR}{level}"] += counters.blocks
        fresh = {name: count - self._seen[name] for name, count in now.items() if count > self._seen[name]}
        self._seen = now
        return fresh
