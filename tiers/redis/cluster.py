"""Redis Cluster routing: the hash slot of a key and the slot map from ``CLUSTER SLOTS``."""

from __future__ import annotations

import binascii
from collections.abc import Callable
from typing import Any, TypeVar

CLUSTER_SLOT_COUNT = 16384
"""Hash slots of a Redis Cluster."""

NodeT = TypeVar("NodeT")


def key_slot(key: bytes) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16/XMODEM, ``{hash tags}`` honoured)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % CLUSTER_SLOT_COUNT


def slot_map(reply: Any, default_host: str, node_of: Callable[[str, int], NodeT]) -> list[NodeT | None]:
    """The owner of every slot from a ``CLUSTER SLOTS`` reply.

    ``node_of(host, port)`` names a master (an empty host means the answering
    node's own, ``default_host``). Raises ``TypeError``/``ValueError``/
    ``IndexError``/``AttributeError`` on a malformed reply.
    """
    if not isinstance(reply, list):
        raise TypeError("CLUSTER SLOTS did not answer a list")
    slots: list[NodeT | None] = [None] * CLUSTER_SLOT_COUNT
    for first, last, master, *_replicas in reply:
        owner = node_of(master[0].decode() or default_host, int(master[1]))
        slots[first : last + 1] = [owner] * (last - first + 1)
    return slots
