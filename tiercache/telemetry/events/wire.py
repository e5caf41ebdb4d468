"""KV events in vLLM's wire format, so a KV-aware router written for vLLM reads tiercache's unchanged.

The messages are msgpack-encoded msgspec structs declared the way vLLM declares
them in ``vllm/distributed/kv_events.py`` (and copies into its example subscriber,
examples/online_serving/kv_events_subscriber.py of vLLM's repository): positional arrays
(``array_like``), trailing defaults left out (``omit_defaults``), and each event
tagged with its class name (``tag=True``), so a ``BlockStored`` goes on the wire as
``["BlockStored", [hashes], parent, [tokens], block_size, lora_id, medium]`` and a
batch as ``[ts, [events], data_parallel_rank]`` (the rank left out when None).
``medium`` carries the tier's name. vLLM's newer releases dropped ``array_like``
(events are maps keyed by field name, the tag in ``type``, and ``BlockStored``
gained ``lora_name``): ``EventsConfig.wire = EventWire.MAP`` publishes that form,
for routers written against those releases.

Block hashes: tiercache's keys are 16-byte BLAKE2b digests (tiercache.blocks.keys); on
the wire a key is the unsigned 64-bit integer of its last 8 bytes, big-endian
(``int.from_bytes(key, "big") & (2**64 - 1)``), the mapping vLLM applies to its own
byte hashes when routers ask for integers (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
It is stable across processes and machines because the keys are.

Needs the ``events`` extra (msgspec; the ZeroMQ publisher also needs pyzmq).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from tiercache.blocks.keys import KEY_BYTES

EXTERNAL_HASH_MASK = (1 << 64) - 1
"""Block hashes on the wire are unsigned 64-bit integers."""
HASH_BYTES = 8
"""Bytes of a key that make its integer hash (its last 8)."""
VECTORISE_FROM = 8
"""Keys per call from which ``block_hashes`` reads them with one numpy view instead of one by one."""
_BIG_ENDIAN_U64 = np.dtype(">u8")
def block_hash(key: bytes) -> int:
    """The integer a router sees for a tiercache key: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(key, "big") & EXTERNAL_HASH_MASK


def block_hashes(keys: Sequence[bytes]) -> list[int]:
    """``block_hash`` of each key; tiercache's 16-byte keys are read in bulk (one join, one view)."""
    if len(keys) >= VECTORISE_FROM:
        joined = b"".join(keys)
        if len(joined) == len(keys) * KEY_BYTES:
            offset = KEY_BYTES - HASH_BYTES
            view = np.ndarray((len(keys),), dtype=_BIG_ENDIAN_U64, buffer=joined, offset=offset, strides=(KEY_BYTES,))
            return view.tolist()
    return [block_hash(key) for key in keys]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events published together: wall-clock time, events, and the data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag on the wire is the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one chain now held by ``medium`` (a tier name)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held by ``medium``."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Everything this engine held is gone (start, reset)."""


class KVEventBatch(EventBatch):
    """The message on the wire: a batch whose events are the three kinds above."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""Any one event."""


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """``EventBatch`` as vLLM's newer releases declare it (a map)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the map-encoded events; the tag (in ``type``) is the same class name as in the array form."""


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    """``BlockStored`` as a map; ``lora_name`` has no default in vLLM, so it is always sent."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    """``BlockRemoved`` as a map."""

    block_hashes: list[int]
    medium: str | None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    """``AllBlocksCleared`` as a map."""


class MapKVEventBatch(MapEventBatch):
    """The map-encoded message."""

    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


def to_map_wire(batch: KVEventBatch, lora_name: str | None = None) -> MapKVEventBatch:
    """The same batch in the map form (``EventWire.MAP``); ``lora_name`` names the model's LoRA adapter."""
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(
                MapBlockStored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    event.lora_id,
                    event.medium,
                    lora_name=lora_name,
                )
            )
        elif isinstance(event, BlockRemoved):
            events.append(MapBlockRemoved(event.block_hashes, event.medium))
        else:
            events.append(MapAllBlocksCleared())
    return MapKVEventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)
