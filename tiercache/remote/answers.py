"""What a ``RemoteStore`` answers: a ``PresenceAnswer`` per key asked, the ``StoreEvent``s of what tiers stored.

Presence is three-valued (docs/architecture.md, "The contract with the engine"):
``HELD`` (with the fastest tier holding the key), ``ABSENT`` (every tier answered
and none holds it) or ``UNKNOWN`` (some tier could not tell), which is neither a
hit nor evidence of removal (``tiercache.movement.presence.first_holder`` and
``combined`` read the tiers' answers). Answers known without asking a tier come as futures already
resolved.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.movement.presence import combined, first_holder
from tiercache.tiers.base import Presence


@dataclass(frozen=True, slots=True)
class PresenceAnswer:
    """The tiers' answer for one key: its presence, and the fastest tier holding it (index) when ``HELD``."""

    presence: Presence
    tier: int | None = None


UNKNOWN = PresenceAnswer(Presence.UNKNOWN)
ABSENT = PresenceAnswer(Presence.ABSENT)


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """Tier ``tier`` (its topology name) now holds ``keys`` (as the caller named them: engine keys or tiercache)."""

    tier: str
    keys: tuple[bytes, ...]


def presence_answer(answers: Sequence[Sequence[Presence]], position: int) -> PresenceAnswer:
    """A key's ``PresenceAnswer`` from every tier's answer."""
    presence = combined(answers, position)
    return PresenceAnswer(presence, first_holder(answers, position) if presence is Presence.HELD else None)


def resolved(value: Any) -> concurrent.futures.Future[Any]:
    """A future that already holds ``value`` (an answer known without asking a tier)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future
