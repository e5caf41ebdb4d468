"""Removal of values that failed validation from the store they came from (DESIGN.md, "Failure").

A value that is truncated, corrupt or from elsewhere would fail its check on
every read and never be rewritten while it sits there. Reads report such values
here; ``Cleaner`` deletes them in the background, off the read's critical path,
best effort: a delete only removes the value if it is still the one that was
read (another writer may have replaced it meanwhile), at most
``MAX_CLEANUPS_IN_FLIGHT`` batches run at once (more are skipped, counted), and
``close`` stops them within its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tiercache.tiers.regional.shutdown import stop_tasks

MAX_CLEANUPS_IN_FLIGHT = 4
"""Background delete batches at once per tier; beyond that invalid values are left for a later read."""

Discard = Callable[[Sequence[Any]], Awaitable[int]]
"""A store's ``discard`` (deletes (key, value-as-read) pairs) or ``discard_invalid`` (deletes keys whose
value still fails validation); returns how many went."""


class Cleaner:
    """Deletes invalid values in the background; counts ``invalid_deleted`` and ``invalid_delete_skipped``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.deleted = 0
        self.skipped = 0
        self._tasks: set[asyncio.Task] = set()

    def discard(self, store: Discard, items: Sequence[Any]) -> None:
        """Schedule the deletion of ``items`` from ``store``; never waits."""
        if not items:
            return
        if len(self._tasks) >= MAX_CLEANUPS_IN_FLIGHT:
            self.skipped += len(items)
            return
        task = asyncio.get_running_loop().create_task(self._run(store, list(items)), name=f"{self.name}-cleanup")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, store: Discard, items: list[Any]) -> None:
        self.deleted += await store(items)

    def tasks(self) -> list[asyncio.Task]:
        """Deletes still in flight."""
        return list(self._tasks)

    async def close(self, deadline_s: float) -> int:
        """Let deletes in flight finish within ``deadline_s`` (then abandon them); how many were abandoned."""
        return await stop_tasks(self.tasks(), grace_s=deadline_s / 2, cancel_s=deadline_s / 2, what=self.name)
