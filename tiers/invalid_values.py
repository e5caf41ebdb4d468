"""What every remote does with a value that fails validation (docs/architecture.md, "Failure, bad input and security").

A value that fails its check would fail every read while it sits in the store,
so a remote removes it and the next store of that block rewrites it. But only a
value the reader can prove damaged (``DecodeStatus.damaged``: not a tiercache
value at all, or one of its own whose key, lengths, checksum, MAC or compression
fail): a value of another namespace, with a MAC under a key this reader does not
hold, without the MAC this reader requires, or of a format it does not know is
valid for someone else, and is left where it is (counted as ``invalid_kept``).
A misconfigured reader, or a co-tenant, can then never wipe a namespace by
reading it.

``InvalidValues`` is the one place that judges and removes. A tier's read
reports each failed value with its status; the damaged ones are removed in the
background, off the read's path, through the tier's ``delete_damaged``; at most
``MAX_DELETES_IN_FLIGHT`` batches run at once (more are skipped, counted: a
later read finds them again), and ``close`` stops them within its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tiercache.blocks.value_format import DecodeStatus
from tiercache.tiers.shutdown import stop_tasks

MAX_DELETES_IN_FLIGHT = 4
"""Background delete batches at once per tier; beyond that damaged values are left for a later read."""
INVALID_DELETED = "invalid_deleted"
"""Stats name: values a read proved damaged and the tier removed."""
INVALID_KEPT = "invalid_kept"
"""Stats name: values that failed validation but are not this reader's to judge, left in place."""
INVALID_DELETE_SKIPPED = "invalid_delete_skipped"
"""Stats name: damaged values not removed because ``MAX_DELETES_IN_FLIGHT`` batches were running."""

DeleteDamaged = Callable[[list[Any]], Awaitable[int]]
"""A tier's removal of damaged values (the items its reads reported); returns how many it removed."""


class InvalidValues:
    """Judges the values a tier's reads found invalid; removes the damaged ones in the background."""

    def __init__(self, name: str, delete: DeleteDamaged) -> None:
        self.name = name
        self._delete = delete
        self.deleted = 0
        self.kept = 0
        self.skipped = 0
        self._tasks: set[asyncio.Task] = set()

    def report(self, found: Iterable[tuple[Any, DecodeStatus]]) -> None:
        """Values a read found invalid, as (item for ``delete``, status); never waits.

        Only damaged ones are removed; the rest are counted as kept. Called on
        the event loop (a deletion is a background task there).
        """
        damaged = []
        for item, status in found:
            if status.damaged:
                damaged.append(item)
            else:
                self.kept += 1
        if not damaged:
            return
        if len(self._tasks) >= MAX_DELETES_IN_FLIGHT:
            self.skipped += len(damaged)
            return
        task = asyncio.get_running_loop().create_task(self._run(damaged), name=f"{self.name}-delete-damaged")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list[Any]) -> None:
        removed = await self._delete(items)  # not ``self.deleted += await ...``: that reads the count before awaiting
        self.deleted += removed

    def tasks(self) -> list[asyncio.Task]:
        """Deletions still in flight."""
        return list(self._tasks)

    async def settle(self) -> None:
        """Wait for the deletions started so far (their failures are the tier's to count, never raised here)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self, deadline_s: float) -> int:
        """Let deletions in flight finish within ``deadline_s`` (then abandon them); how many were abandoned."""
        return await stop_tasks(self.tasks(), grace_s=deadline_s / 2, cancel_s=deadline_s / 2, what=self.name)

    def stats(self) -> dict[str, float]:
        """``invalid_deleted``, ``invalid_kept`` and ``invalid_delete_skipped``."""
        return {
            INVALID_DELETED: float(self.deleted),
            INVALID_KEPT: float(self.kept),
            INVALID_DELETE_SKIPPED: float(self.skipped),
        }
