"""The background runtime: one event-loop thread, the tasks it runs, and a bounded close.

The engine's scheduler calls the manager synchronously; remote I/O and waits on
copies run as coroutines on one background loop, so the scheduler never blocks.
Every task started here is tracked, so ``close`` can give work in flight a
deadline, cancel what is left, and return whatever a remote does meanwhile.
An exception in a background task is logged, never re-raised into the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

CLOSE_DRAIN_SECONDS = 5.0
"""How long an owner's ``close`` lets tracked work in flight finish before cancelling it."""
CANCEL_GRACE_SECONDS = 1.0
"""How long cancelled tasks get to unwind before the loop is stopped anyway."""


class Runtime:
    """A daemon thread running an asyncio loop; coroutines are submitted from any thread."""

    def __init__(self, name: str = "tiercache-io") -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._log_exception)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._tasks: set[concurrent.futures.Future[Any]] = set()

    @staticmethod
    def _log_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        log.error("tiercache background task failed: %s", context.get("message"), exc_info=context.get("exception"))

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def start_with(self, connect: Awaitable[object], timeout_s: float, owner: str) -> None:
        """Start the loop and run ``connect`` on it, waiting at most ``timeout_s``: what is still connecting
        then, or failed, is logged and reads as misses until it answers (never raised into the engine)."""
        self.start()
        connecting = self.submit(connect, track=False)
        try:
            connecting.result(timeout_s)
        except concurrent.futures.TimeoutError:
            log.warning("%s: remotes still connecting after %.1f s; continuing", owner, timeout_s)
        except Exception:
            log.exception("%s: a remote tier failed to start; it reads as misses", owner)

    def submit(self, coroutine: Awaitable[T], *, track: bool = True) -> concurrent.futures.Future[T]:
        """Schedule ``coroutine`` on the loop; the future is thread-safe.

        Tracked work (the default) is what ``drain`` waits for; lifecycle calls
        themselves (start, the close sequence) are not tracked.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)  # type: ignore[arg-type]
        if track:
            self._tasks.add(future)
            future.add_done_callback(self._finished)
        return future

    def _finished(self, future: concurrent.futures.Future[Any]) -> None:
        self._tasks.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("tiercache background task failed", exc_info=future.exception())

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop thread (from any thread)."""
        self.loop.call_soon_threadsafe(callback, *args)

    @property
    def pending(self) -> int:
        """Tracked tasks not finished yet."""
        return sum(not task.done() for task in list(self._tasks))

    async def drain(self, deadline_s: float) -> None:
        """On the loop: wait up to ``deadline_s`` for tracked work, then cancel what is left of it."""
        waiting = [task for task in list(self._tasks) if not task.done()]
        if waiting:
            await asyncio.wait([asyncio.wrap_future(task) for task in waiting], timeout=deadline_s)
        for task in waiting:
            task.cancel()

    async def _cancel_everything(self) -> None:
        """Cancel every task still on the loop (the tiers' own included); abandon those that ignore it."""
        current = asyncio.current_task()
        leftovers = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
        for task in leftovers:
            task.cancel()
        if leftovers:
            _, stuck = await asyncio.wait(leftovers, timeout=CANCEL_GRACE_SECONDS)
            if stuck:
                log.warning("close: %d background tasks ignored cancellation; abandoning them", len(stuck))

    def stop(self) -> None:
        """Cancel what is left (bounded), stop the loop and join the thread (call ``drain`` first)."""
        if not self._started or self.loop.is_closed():
            return
        try:
            self.submit(self._cancel_everything(), track=False).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
