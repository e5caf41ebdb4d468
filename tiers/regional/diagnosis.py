"""Why calls to central or a region fail: named causes, counted in ``stats()`` and logged (rate-limited).

A rejected password, a missing one, an ACL denial and a full server look alike
from far away (replication stops, reads miss). Each failure of a call or of one
command in a pipeline is classified by the server's error code (``NOAUTH``,
``WRONGPASS``, ``NOPERM``, ``OOM``) or as unreachable (refused, reset, timed
out) or another error, counted per server as ``{central,region}_errors_{cause}``,
and logged with its cause: the first of each cause at once, then at most once per
``LOG_INTERVAL_S`` with the count since (a server failing every call must not
flood the log).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0
"""At most one log line per server and cause in this many seconds."""


class Cause(enum.Enum):
    """Why a call or command failed."""

    NOAUTH = "noauth"
    """The server requires a password and none was given."""
    WRONGPASS = "wrongpass"
    """The server rejected the user name or password."""
    NOPERM = "noperm"
    """An ACL denies this user the command or key."""
    OOM = "oom"
    """The server is at maxmemory and does not evict (writes refused)."""
    UNREACHABLE = "unreachable"
    """Refused, reset or timed out."""
    OTHER = "other"
    """Any other error reply."""


CAUSE_BY_CODE = {"NOAUTH": Cause.NOAUTH, "WRONGPASS": Cause.WRONGPASS, "NOPERM": Cause.NOPERM, "OOM": Cause.OOM}
"""Redis error codes (the reply's first word) that name a cause."""
AUTH_CAUSES = frozenset({Cause.NOAUTH, Cause.WRONGPASS, Cause.NOPERM})
"""Causes that a configuration change (password, ACL) fixes, not waiting."""
HINTS = {
    Cause.NOAUTH: "the server requires a password: put it in the URL (redis://:PASSWORD@host:port)",
    Cause.WRONGPASS: "the server rejected the user name or password in the URL",
    Cause.NOPERM: "an ACL rule denies this user a command or key the tier needs",
    Cause.OOM: "the server is full and does not evict: writes fail until it has room",
    Cause.UNREACHABLE: "refused, reset or timed out",
    Cause.OTHER: "unexpected error reply",
}


OUTCOME_CAUSES = {
    "auth_noauth": Cause.NOAUTH,
    "auth_wrongpass": Cause.WRONGPASS,
    "auth_noperm": Cause.NOPERM,
    "refused_noperm": Cause.NOPERM,
    "server_oom": Cause.OOM,
    "connect": Cause.UNREACHABLE,
    "connection": Cause.UNREACHABLE,
    "timeout": Cause.UNREACHABLE,
    "closed": Cause.UNREACHABLE,
}
"""The cause of each outcome the Redis tier's data path counts a failure under (any other: OTHER)."""


def classify(error: BaseException) -> Cause:
    """The cause of a redis-py exception (or an OSError)."""
    code = getattr(error, "status_code", None)
    if code is None:
        first = str(error).split(" ", 1)[0]
        code = first if first in CAUSE_BY_CODE else None
    if code in CAUSE_BY_CODE:
        return CAUSE_BY_CODE[code]
    if "invalid username-password" in str(error) or "invalid password" in str(error):
        return Cause.WRONGPASS
    if isinstance(error, (OSError, TimeoutError, RedisConnectionError, RedisTimeoutError)):
        return Cause.UNREACHABLE
    return Cause.OTHER


def display_url(url: str) -> str:
    """``url`` without its user name and password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}"


class Diagnosis:
    """Failure causes of one server (``role``: central or region), counted and logged."""

    def __init__(
        self,
        tier: str,
        role: str,
        url: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_record: Callable[[str], None] | None = None,
    ) -> None:
        self.tier = tier
        self.on_record = on_record
        """Told each failure in words (the tier's ``note_error``, so its ``last_error`` names the cause)."""
        self.role = role
        self.where = display_url(url)
        self.counts = dict.fromkeys(Cause, 0)
        self.last: Cause | None = None
        """The most recent cause seen (None until one is)."""
        self.last_error = ""
        """The most recent error's message."""
        self._clock = clock
        self._logged_at: dict[Cause, float] = {}
        self._unlogged = dict.fromkeys(Cause, 0)

    def record(self, error: BaseException, what: str) -> Cause:
        """Count and (rate-limited) log one failure of ``what`` (e.g. "commit"); returns its cause."""
        return self._record(classify(error), error, what)

    def record_outcome(self, outcome: str, message: str, what: str) -> Cause:
        """Like ``record``, for a failure the data path (``plane``) counted under ``outcome``."""
        return self._record(OUTCOME_CAUSES.get(outcome, Cause.OTHER), message, what)

    def _record(self, cause: Cause, error: BaseException | str, what: str) -> Cause:
        self.counts[cause] += 1
        self.last = cause
        self.last_error = str(error)
        if self.on_record is not None:
            self.on_record(f"{self.role} {self.where}: {what}: {cause.name}: {error}")
        self._unlogged[cause] += 1
        now = self._clock()
        logged_at = self._logged_at.get(cause)
        if logged_at is None or now - logged_at >= LOG_INTERVAL_S:
            level = logging.DEBUG if cause is Cause.UNREACHABLE else logging.WARNING
            log.log(
                level,
                "regional tier %s: %s %s: %s failed with %s (%s: %s); %d time(s) since the last report",
                self.tier,
                self.role,
                self.where,
                what,
                cause.name,
                HINTS[cause],
                error,
                self._unlogged[cause],
            )
            self._logged_at[cause] = now
            self._unlogged[cause] = 0
        return cause

    def explain(self) -> str:
        """The last failure in words: cause, hint and the server's message."""
        if self.last is None:
            return "no error seen: the circuit breaker is open, or the answer was not what was written"
        return f"{self.last.name}: {HINTS[self.last]} ({self.last_error})"

    def stats(self) -> dict[str, float]:
        """``{role}_errors_{cause}`` for every cause, and ``{role}_auth_failed`` (NOAUTH + WRONGPASS + NOPERM)."""
        stats = {f"{self.role}_errors_{cause.value}": float(count) for cause, count in self.counts.items()}
        stats[f"{self.role}_auth_failed"] = float(sum(self.counts[cause] for cause in AUTH_CAUSES))
        return stats
