"""Small reusable checks for option values, shared by every ``Options`` dataclass.

An ``Options`` dataclass validates itself in ``__post_init__`` with these; a
failed check raises ``FieldError`` (a ``ValueError``) naming the field, what
was expected and what came, and ``tiercache.config`` turns it into a
``ConfigError`` with the file and the full field path
(``tiers[2].options.central_url``). The bounds below are sanity limits: a value
past them is a typo or a unit mistake, never a real deployment, and would hang
or exhaust the machine at start instead of failing at load time.
"""

from __future__ import annotations

import math
import re
from typing import Any

from tiercache.common.units import MS_PER_SECOND

MAX_WORKERS = 1024
"""Most threads, connections or worker tasks one tier (or queue) may start."""
MAX_QUEUE_ITEMS = 1 << 24
"""Most blocks one in-memory queue or batch may hold."""
MAX_TIMEOUT_S = 24 * 3600.0
"""Longest timeout, interval or back-off in seconds: longer is a unit mistake (ms given as s)."""
MAX_TIMEOUT_MS = MAX_TIMEOUT_S * MS_PER_SECOND
"""``MAX_TIMEOUT_S`` for fields given in milliseconds."""
MAX_RETRIES = 1000
"""Most retries of one operation."""

_MISSING = object()


class FieldError(ValueError):
    """A bad option value: the field's name, what was expected, and what came."""

    def __init__(self, field: str, expected: str, got: Any = _MISSING) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        got_text = "" if got is _MISSING else f", got {got!r}"
        super().__init__(f"{field}: expected {expected}{got_text}")

    @property
    def has_value(self) -> bool:
        """Whether the offending value is known (``got`` was given)."""
        return self.got is not _MISSING


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_in_range(field: str, value: Any, low: int, high: int) -> int:
    """An integer in ``[low, high]``."""
    if not _is_int(value) or not low <= value <= high:
        raise FieldError(field, f"an integer in [{low}, {high}]", value)
    return value


def number_in_range(field: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    bracket = "(" if low_open else "["
    if (
        not _is_number(value)
        or not math.isfinite(value)
        or value > high
        or value < low
        or (low_open and value == low)
    ):
        raise FieldError(field, f"a number in {bracket}{low}, {high}]", value)
    return value


def positive_timeout_s(field: str, value: Any) -> float:
    """A timeout or interval in seconds: > 0 (0 or less would disable what it guards) and sane."""
    return number_in_range(field, value, 0.0, MAX_TIMEOUT_S, low_open=True)


def positive_timeout_ms(field: str, value: Any) -> float:
    """A timeout in milliseconds: > 0 and sane."""
    return number_in_range(field, value, 0.0, MAX_TIMEOUT_MS, low_open=True)


def worker_count(field: str, value: Any) -> int:
    """A number of threads, connections or tasks: 1 to ``MAX_WORKERS``."""
    return int_in_range(field, value, 1, MAX_WORKERS)


def queue_size(field: str, value: Any, low: int = 1) -> int:
    """A number of blocks queued or batched: ``low`` to ``MAX_QUEUE_ITEMS``."""
    return int_in_range(field, value, low, MAX_QUEUE_ITEMS)


def fraction(field: str, value: Any, *, low_open: bool = False) -> float:
    """A number in ``[0, 1]`` (``(0, 1]`` with ``low_open``)."""
    return number_in_range(field, value, 0.0, 1.0, low_open=low_open)


def non_empty_string(field: str, value: Any) -> str:
    """A string with at least one non-blank character."""
    if not isinstance(value, str) or not value.strip():
        raise FieldError(field, "a non-empty string", value)
    return value


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """``4GiB``, ``512 MB`` or a plain integer -> bytes (ValueError if malformed)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE_PATTERN.match(str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
