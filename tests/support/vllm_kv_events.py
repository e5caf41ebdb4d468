"""vLLM's KV-event messages as vLLM declares them, and a ZeroMQ subscriber of an ``EventSink``.

The message structs are copied from vLLM, not imported from tiercache's own
``tiercache.telemetry.events.wire``: decoding with them is the independent check
that what tiercache publishes is what a router written for vLLM reads.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

if TYPE_CHECKING:
    from tiercache.telemetry.events.sink import EventSink

TOPIC = "kv-events"
DELIVERY_TIMEOUT_MS = 10_000
"""Generous bound for a message that was sent to arrive (never a speed threshold)."""
JOIN_ATTEMPTS = 100
"""Marker batches sent at most while a new SUB socket's subscription reaches the PUB (slow joiner)."""
JOIN_POLL_MS = 100


# --- The reference: vLLM's message definitions, copied as vLLM declares them --------------------
# (vllm/distributed/kv_events.py, the release with `medium` and `data_parallel_rank`, and
# examples/online_serving/kv_events_subscriber.py, whose EventBatch has no rank field).
# Alike in shape to tiercache.telemetry.events.wire on purpose, and never shared with it: a change
# there that vLLM's routers could not read must fail here.


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(VllmKVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(VllmKVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(VllmKVCacheEvent):
    pass


class KVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ExampleEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class ExampleKVEventBatch(ExampleEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM's newer releases (the same file, later): no array_like, so maps keyed by field name.


class NewerEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NewerKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class NewerBlockStored(NewerKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class NewerBlockRemoved(NewerKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class NewerAllBlocksCleared(NewerKVCacheEvent, tag="AllBlocksCleared"):
    pass


class NewerKVEventBatch(NewerEventBatch):
    events: list[NewerBlockStored | NewerBlockRemoved | NewerAllBlocksCleared]


# --- a subscriber -----------------------------------------------------------------------------


def keys(n: int, salt: int = 0) -> list[bytes]:
    """``n`` distinct 16-byte keys (``salt`` makes another set)."""
    return [hashlib.blake2b(bytes([salt, i]), digest_size=16).digest() for i in range(n)]


def joined_subscriber(sink: EventSink, context: zmq.Context) -> tuple[zmq.Socket, int]:
    """A SUB socket that has provably joined: marker batches until one arrives; returns its last seq."""
    sub = context.socket(zmq.SUB)
    sub.connect(sink._publisher.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    for _ in range(JOIN_ATTEMPTS):
        sink.removed("join-marker", keys(1, salt=255))
        assert sink.flush()
        if sub.poll(JOIN_POLL_MS):
            last_sent = sink.stats()["published"] - 1
            while receive(sub)[1] != last_sent:  # drain the markers still on their way
                pass
            return sub, last_sent
    raise AssertionError("the subscriber never joined")


def receive(sub: zmq.Socket) -> tuple[bytes, int, bytes]:
    """The next message on ``sub`` (bounded wait): topic, sequence number, payload."""
    assert sub.poll(DELIVERY_TIMEOUT_MS), "a published batch never arrived"
    topic, seq_bytes, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq_bytes, "big"), payload
