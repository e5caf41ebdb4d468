"""Room at a full central: when a commit is refused for memory (OOM), the tier removes old values itself.

A central at ``maxmemory`` that does not evict what the tier writes
(``noeviction``, or ``volatile-*`` without ``central_ttl_s``) refuses every
commit: replication would stop for good and force_latest would find nothing new.
So on an OOM the tier frees room the way Redis's own eviction would: it samples
the version keys under its prefix (``SCAN``, a bounded number per call, resuming
where the last call stopped), and removes the values with the oldest versions
(oldest commits first) with their version keys, until twice the refused bytes
are freed; then the refused commits are tried again. A removed value is a cache
miss, never a stale hit: force_latest reads of a key without a version key are
misses. Counted (``freed``, ``freed_bytes``) and logged, rate-limited, while it
lasts.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from tiercache.tiers.regional.client import GuardedClient
from tiercache.tiers.regional.diagnosis import LOG_INTERVAL_S

log = logging.getLogger(__name__)

ROOM_FACTOR = 2
"""Free this many times the bytes a full central refused (per-key overhead, and room for what follows)."""
SAMPLE_KEYS = 128
"""Version keys one call compares (the oldest of them go first), like Redis's ``maxmemory-samples``."""
SCAN_PAGE_KEYS = 64
SCAN_MAX_PAGES = 32
"""A call reads at most this many SCAN pages, so it never blocks central for long."""
GLOB_SPECIALS = re.compile(r"([*?\[\]\\])")

FREE_OLDEST_SCRIPT = f"""
-- ARGV: version-key pattern, bytes to free, SCAN cursor. Returns {{values removed, bytes freed, next cursor}}.
local cursor = ARGV[3]
local found = {{}}
local pages = 0
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', {SCAN_PAGE_KEYS})
  cursor = page[1]
  pages = pages + 1
  for _, name in ipairs(page[2]) do
    local version = tonumber(redis.call('GET', name) or '')
    if version then found[#found + 1] = {{version, name}} end
  end
until cursor == '0' or #found >= {SAMPLE_KEYS} or pages >= {SCAN_MAX_PAGES}
table.sort(found, function(a, b) return a[1] < b[1] end)
local freed, removed = 0, 0
for _, entry in ipairs(found) do
  if freed >= tonumber(ARGV[2]) then break end
  local value = string.sub(entry[2], 1, -2) .. 'v'
  freed = freed + redis.call('STRLEN', value)
  redis.call('DEL', value, entry[2])
  removed = removed + 1
end
return {{removed, freed, cursor}}
"""
"""Remove the values with the oldest versions among a sample of version keys (``{p}{hex}:n`` -> ``{p}{hex}:v``)."""


class Room:
    """Frees room at a full central for the commits it refused (see the module docstring)."""

    def __init__(
        self, server: GuardedClient, prefix: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.server = server
        self.pattern = GLOB_SPECIALS.sub(r"\\\1", prefix) + "{*}:n"
        """SCAN's pattern for the version keys (``_Keys.version``), the prefix's glob characters escaped."""
        self.freed = 0
        """Values removed to make room."""
        self.freed_bytes = 0
        self.refused = 0
        """Commits central refused for memory."""
        self._cursor = b"0"
        self._clock = clock
        self._logged_at: float | None = None
        self._unlogged = [0, 0, 0]
        """Refused, removed and bytes freed since the last log line."""

    async def make(self, refused: int, refused_bytes: int) -> int:
        """Central refused ``refused`` commits (``refused_bytes``) for memory: remove the oldest values until
        ``ROOM_FACTOR`` times that is freed (one bounded call); the bytes freed (0 when it could not)."""
        target = ROOM_FACTOR * refused_bytes
        reply = await self.server.call(
            lambda client: client.eval(FREE_OLDEST_SCRIPT, 0, self.pattern, target, self._cursor), None, "free room"
        )
        removed, freed = 0, 0
        if isinstance(reply, list) and len(reply) == 3:
            removed, freed, self._cursor = int(reply[0]), int(reply[1]), reply[2]
        self.refused += refused
        self.freed += removed
        self.freed_bytes += freed
        self._report(refused, removed, freed)
        return freed

    def stats(self, role: str) -> dict[str, float]:
        """``{role}_full_refused``, ``{role}_freed`` and ``{role}_freed_bytes``."""
        return {
            f"{role}_full_refused": float(self.refused),
            f"{role}_freed": float(self.freed),
            f"{role}_freed_bytes": float(self.freed_bytes),
        }

    def _report(self, refused: int, removed: int, freed: int) -> None:
        """A warning at most once per ``LOG_INTERVAL_S`` with the counts since the last one."""
        self._unlogged = [self._unlogged[0] + refused, self._unlogged[1] + removed, self._unlogged[2] + freed]
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < LOG_INTERVAL_S:
            return
        refused, removed, freed = self._unlogged
        diagnosis = self.server.diagnosis
        log.warning(
            "regional tier %s: central %s is full and does not evict: %d commit(s) refused (OOM); removed the %d "
            "oldest value(s) (%d bytes) to make room (set an allkeys-* maxmemory-policy or central_ttl_s to let "
            "central evict by itself)",
            diagnosis.tier,
            diagnosis.where,
            refused,
            removed,
            freed,
        )
        self._logged_at = now
        self._unlogged = [0, 0, 0]
