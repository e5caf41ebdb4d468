"""Bounded stops of a tier's background tasks: cancel, wait bounded, then abandon with a log line.

A plain ``task.cancel(); await task`` can wait forever: on Python 3.11 a cancel
that lands as an inner ``asyncio.wait_for`` (redis-py uses it) finishes can be
swallowed, so the task keeps running. ``stop_tasks`` therefore never awaits a
task without a bound: it re-cancels until the task is done or the deadline
passes, and gives up on what is left (logged, and reported to the caller). The
tasks themselves also check a stop flag, so a swallowed cancel only delays them.
``asyncio.wait_for`` is not used for this: on timeout it waits for the cancelled
inner task without a bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)
RECANCEL_INTERVAL_S = 0.05
"""How often a task that ignored its cancel is cancelled again while ``stop_tasks`` waits."""


async def stop_tasks(tasks: Iterable[asyncio.Task], *, grace_s: float, cancel_s: float, what: str) -> int:
    """Let ``tasks`` finish for ``grace_s``, then cancel them (again and again) for at most ``cancel_s``.

    Returns how many were abandoned (still running at the deadline; a warning
    names them). Exceptions of finished tasks are logged, never raised.
    """
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    pending = {task for task in tasks if not task.done()}
    if pending and grace_s > 0:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    end = loop.time() + cancel_s
    while pending:
        for task in pending:
            task.cancel()
        remaining = end - loop.time()
        if remaining <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(remaining, RECANCEL_INTERVAL_S))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.warning("%s: background task %s failed", what, task.get_name(), exc_info=task.exception())
    if pending:
        log.warning(
            "%s: %d background task(s) did not stop within %.2f s; abandoned: %s",
            what,
            len(pending),
            grace_s + cancel_s,
            ", ".join(sorted(task.get_name() for task in pending)),
        )
    return len(pending)
