"""The ``events`` section of a topology: where KV events go (off by default).

Kept apart from ``tiercache.telemetry.events.wire`` so a topology loads without the ``events``
extra (msgspec, pyzmq) installed; those are imported only when events are on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_TOPIC = "kv-events"
"""The topic vLLM's example subscriber subscribes to."""
DEFAULT_MAX_QUEUE = 100_000
"""Engine-side events buffered before new ones are dropped (counted); vLLM's queue bound."""
DEFAULT_REPLAY_BATCHES = 10_000
"""Published batches kept for replay; vLLM's ``buffer_steps``."""
DEFAULT_REPLAY_BYTES = 64 << 20
"""Payload bytes kept for replay (the oldest batches go first past it)."""
DEFAULT_HWM = 100_000
"""ZeroMQ high-water mark of the PUB socket; vLLM's default."""
DEFAULT_LINEAGE_BLOCKS = 0
"""Blocks whose parent and tokens are remembered for the events of their later copies (0: none)."""
DEFAULT_FLUSH_INTERVAL_S = 0.005
"""How often the background thread turns queued events into one batch (and serves replays)."""



class EventWire(enum.Enum):
    """How batches are encoded for the ZeroMQ publisher."""

    ARRAY = "array"
    """Positional arrays: the vLLM releases whose example subscriber declares ``array_like``."""
    MAP = "map"
    """Maps keyed by field name: vLLM's newer releases."""


@dataclass
class EventsConfig:
    """KV events: off by default; in-process subscribers need only ``enabled``, a router needs ``endpoint``."""

    enabled: bool = False
    endpoint: str | None = None
    """ZeroMQ PUB address the publisher binds, e.g. ``tcp://*:5557``; None: in-process subscribers only."""
    replay_endpoint: str | None = None
    """ZeroMQ ROUTER address for replaying missed batches, e.g. ``tcp://*:5558``; None: no replay."""
    topic: str = DEFAULT_TOPIC
    wire: EventWire = EventWire.ARRAY
    data_parallel_rank: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    replay_batches: int = DEFAULT_REPLAY_BATCHES
    replay_bytes: int = DEFAULT_REPLAY_BYTES
    """Most payload bytes kept for replay, whatever ``replay_batches`` allows."""
    hwm: int = DEFAULT_HWM
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    lineage_blocks: int = DEFAULT_LINEAGE_BLOCKS
    """Remember parent and tokens of this many recently computed blocks, so the ``BlockStored`` of a
    block demoted or promoted later by key carries them too (about block_size x 8 bytes each)."""

    def __post_init__(self) -> None:
        if self.lineage_blocks < 0:
            raise ValueError(f"lineage_blocks: expected an integer >= 0, got {self.lineage_blocks!r}")
        for name in ("max_queue", "replay_batches", "replay_bytes", "hwm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected an integer > 0, got {getattr(self, name)!r}")
        if not self.flush_interval_s > 0:
            raise ValueError(f"flush_interval_s: expected a number > 0, got {self.flush_interval_s!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(f"{name}: expected a ZeroMQ address such as tcp://*:5557, got {value!r}")
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("replay_endpoint: needs endpoint (replay serves batches the publisher sent)")


