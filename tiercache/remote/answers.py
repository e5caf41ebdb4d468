"""What a ``RemoteStore`` answers: a probe's ``Found`` per key, the ``StoreEvent``s of what tiers stored.

A probe's presence is DESIGN's three-valued one: ``HELD`` (with the fastest tier
holding the key), ``ABSENT`` (every tier answered and none holds it) or
``UNKNOWN`` (some tier could not tell), which is neither a hit nor evidence of
removal. Answers known without asking a tier come as futures already resolved.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.tiers.base import Presence


@dataclass(frozen=True, slots=True)
class Found:
    """A probe's answer for one key: its presence, and the fastest tier holding it (index) when ``HELD``."""

    presence: Presence
    tier: int | None = None


UNKNOWN = Found(Presence.UNKNOWN)
ABSENT = Found(Presence.ABSENT)


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """Tier ``tier`` (its topology name) now holds ``keys`` (as the caller named them: engine keys or tiercache)."""

    tier: str
    keys: tuple[bytes, ...]


def first_holder(answers: Sequence[Sequence[Presence]], position: int) -> int | None:
    """The first (fastest) tier whose answer says it holds the key at ``position``, or None."""
    for tier, answer in enumerate(answers):
        if answer[position] is Presence.HELD:
            return tier
    return None


def first_found(answers: Sequence[Sequence[Presence]], position: int) -> Found:
    """A key's ``Found`` from every tier's answer: the first holder, else ABSENT only if every tier said so."""
    tier = first_holder(answers, position)
    if tier is not None:
        return Found(Presence.HELD, tier)
    return ABSENT if all(answer[position] is Presence.ABSENT for answer in answers) else UNKNOWN


def resolved(value: Any) -> concurrent.futures.Future[Any]:
    """A future that already holds ``value`` (an answer known without asking a tier)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future
