"""The handle of a load or store moving in the background: Transfer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any


class TransferKind(enum.Enum):
    LOAD = "load"
    STORE = "store"


@dataclass(eq=False)
class Transfer:
    """A load or store moving in the background.

    ``done()`` polls, ``await transfer`` waits from an asyncio engine, ``result()``
    returns the tokens loaded (load: a prefix of those asked for, the rest to be
    recomputed) or indexed (store). ``cancel()`` stops a load early; what it had
    already loaded stays valid and is reported.
    """

    kind: TransferKind
    num_blocks: int
    block_size: int
    gpu_block_ids: list[int] = field(default_factory=list)
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    progress_blocks: int = 0
    settling: bool = False
    layer_events: list[list[Any]] = field(default_factory=list, repr=False)
    """On CUDA, for a layer-major pool: per copy issued so far, one event per layer (see ``wait_layer``)."""
    on_cancel: Callable[[], None] | None = field(default=None, repr=False)

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> int:
        """Tokens moved; blocks until done (call after ``done()`` in a scheduler loop)."""
        return self.future.result(timeout)

    def wait_layer(self, layer: int, stream: Any) -> None:
        """Make a CUDA ``stream`` wait until ``layer`` of every block copied so far has landed.

        Layer-wise overlap: attention on early layers can start while later layers
        of a load still cross the bus. It covers the copies issued so far
        (``progress_blocks`` grows as chunks are handed over); after ``done()``,
        every block is covered. A no-op where the copy has no per-layer events.
        """
        for events in list(self.layer_events):
            stream.wait_event(events[layer])

    def cancel(self) -> None:
        """Finish as soon as the copy in flight lands, with what has arrived."""
        if not self.settling:
            self.settling = True
            if self.on_cancel is not None:
                self.on_cancel()

    def __await__(self) -> Generator[Any, None, int]:
        return asyncio.wrap_future(self.future).__await__()
